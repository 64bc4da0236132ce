"""The built-in training text: English sentences about distributed training, from a small grammar.

Why generate text instead of shipping a file? It needs no download, and a small grammar
makes text that a small GPT can learn in a few hundred steps: the sentences repeat their
structure (so the model quickly gets well below the unigram entropy) but differ in their
words and numbers (so it cannot just memorise one page). The numbers are mostly right:
"an all-reduce of 4096 bytes over 4 ranks sends 6144 bytes from each rank" is what the ring
really does, so the text a trained model writes back reads like a (slightly confused)
lecture on this project.

Determinism: the only source of randomness is `_Lcg`, a 64-bit linear congruential generator
in plain integer arithmetic (Knuth's MMIX constants). No `random`, no NumPy, no dict order,
so the bytes are identical on every machine and every Python and NumPy version.

Shape of the text: paragraphs of 4 to 7 sentences on one topic (pipelines, data parallelism,
tensor parallelism, ZeRO, collectives, the model, the training loop), one paragraph per line,
a blank line between paragraphs. All ASCII, so one character is one byte token.
"""

TARGET_BYTES = 400_000  # generate paragraphs until the text is at least this long
SEED = 20240601


class _Lcg:
    """x <- a x + c mod 2^64; the high bits are the good ones, so draws use x >> 33."""

    def __init__(self, seed):
        self.x = seed % 2**64

    def below(self, n):  # an integer in [0, n)
        self.x = (self.x * 6364136223846793005 + 1442695040888963407) % 2**64
        return (self.x >> 33) % n

    def choice(self, seq):
        return seq[self.below(len(seq))]


_WORDS = {1: "one", 2: "two", 3: "three", 4: "four", 6: "six", 8: "eight", 12: "twelve",
          16: "sixteen", 24: "twenty-four", 32: "thirty-two"}
_FRACTION = {2: "one half", 4: "one quarter", 8: "one eighth"}


def _loss(step):  # a plausible loss curve in integer arithmetic: 5.50 at step 0 -> 1.20
    centi = 120 + 430 * 300 // (step + 300)
    return f"{centi // 100}.{centi % 100:02d}"


# Slots: each {name} in a template is drawn on first use (by _Fill, below). A slot is a
# function of the fill, so derived numbers agree with the drawn ones ("sent" with "n", "p").
_SLOTS = {
    # ranks, stages and their neighbours
    "p": lambda f: f.rng.choice([2, 4, 8]),
    "pw": lambda f: _WORDS[f["p"]],
    "r": lambda f: f.rng.below(f["p"]),
    "right": lambda f: (f["r"] + 1) % f["p"],
    "left": lambda f: (f["r"] - 1) % f["p"],
    "s": lambda f: f.rng.below(f["p"] - 1),  # a stage that has a next stage
    "s1": lambda f: f["s"] + 1,
    "last": lambda f: f["p"] - 1,
    "frac": lambda f: _FRACTION[f["p"]],
    "rounds": lambda f: {2: "one round", 4: "two rounds", 8: "three rounds"}[f["p"]],
    "ring_steps": lambda f: 2 * (f["p"] - 1),
    "gather_steps": lambda f: f["p"] - 1,
    # pipeline schedule: GPipe's bubble is (p - 1) of (m + p - 1) time slots
    "m": lambda f: f.rng.choice([4, 8, 16, 32]),
    "mw": lambda f: _WORDS[f["m"]],
    "slots": lambda f: f["m"] + f["p"] - 1,
    "idle": lambda f: f["p"] - 1,
    # batches
    "B": lambda f: f.rng.choice([32, 64, 128, 256]),
    "per": lambda f: f["B"] // f["p"],
    "micro": lambda f: f["per"] // 4,
    "T": lambda f: f.rng.choice([64, 128, 256]),
    "tokens": lambda f: f["B"] * f["T"],
    # tensor parallelism: h heads over t ranks
    "h": lambda f: f.rng.choice([8, 12, 16]),
    "t": lambda f: f.rng.choice({8: [2, 4], 12: [2, 3, 4], 16: [2, 4, 8]}[f["h"]]),
    "tw": lambda f: _WORDS[f["t"]],
    "hpr": lambda f: f["h"] // f["t"],
    "C": lambda f: f.rng.choice([128, 256, 512, 768]),
    "C4": lambda f: 4 * f["C"],
    "Ct": lambda f: 4 * f["C"] // f["t"],
    # collectives: a ring all-reduce of n bytes sends 2 (p - 1) / p * n bytes per rank
    "n": lambda f: f.rng.choice([1024, 4096, 65536, 1048576]),
    "sent": lambda f: 2 * (f["p"] - 1) * f["n"] // f["p"],
    "chunk": lambda f: f["n"] // f["p"],
    "mb": lambda f: f.rng.choice([1, 4, 16, 25]),
    # training loop
    "step": lambda f: f.rng.below(50) * 100,
    "loss": lambda f: _loss(f["step"]),
    "lr": lambda f: f.rng.choice(["3e-4", "6e-4", "1e-3"]),
    "warm": lambda f: f.rng.choice([100, 200, 500, 1000]),
    "clip": lambda f: f.rng.choice(["1.0", "0.5"]),
    "L": lambda f: f.rng.choice([8, 12, 16, 24]),  # at least p, one layer per stage or more
    "Lw": lambda f: _WORDS[f["L"]],
    "per_stage": lambda f: f["L"] // f["p"],
    "zero_stage": lambda f: f.rng.choice(["one", "two", "three"]),
    # small words, so the same idea is said in more than one way
    "each": lambda f: f.rng.choice(["each", "every"]),
    "sends": lambda f: f.rng.choice(["sends", "passes", "hands"]),
    "then": lambda f: f.rng.choice(["then", "after that"]),
    "fast": lambda f: f.rng.choice(["fast", "quick", "cheap"]),
    "slow": lambda f: f.rng.choice(["slow", "busy", "late"]),
    "linear": lambda f: f.rng.choice(["query, key and value projection", "first MLP layer",
                                      "attention projection", "second MLP layer"]),
    "coll": lambda f: f.rng.choice(["all-reduce", "all-gather", "reduce-scatter", "broadcast"]),
}


# Slots redrawn in every sentence; all the others (the numbers) are drawn once per paragraph,
# so a paragraph that starts with "four ranks" keeps talking about four ranks.
_PER_SENTENCE = {"each", "sends", "then", "fast", "slow", "linear", "coll"}


class _Fill(dict):
    """The values of one sentence's slots, drawn the first time a template asks for them."""

    def __init__(self, rng, paragraph=None):
        super().__init__()
        self.rng, self.paragraph = rng, paragraph

    def __missing__(self, name):
        if self.paragraph is not None and name not in _PER_SENTENCE:
            value = self.paragraph[name]
        else:
            value = _SLOTS[name](self)
        self[name] = value
        return value


_INTROS = {
    "pipeline": [
        "pipeline parallelism cuts the model into {pw} stages, one per rank.",
        "consider a pipeline of {p} stages and {m} micro-batches.",
        "here is how a pipeline moves a batch through the layers.",
        "a model with {L} layers on {p} stages gives {each} stage {per_stage} layers in a row.",
    ],
    "data": [
        "data parallelism copies the whole model to {each} rank.",
        "consider {pw} ranks that train one model on a global batch of {B} sequences.",
        "here is what data parallel ranks do in one step.",
    ],
    "tensor": [
        "tensor parallelism splits {each} layer across {tw} ranks.",
        "consider a layer of width {C} on {t} tensor parallel ranks.",
        "here is how Megatron splits a transformer block.",
    ],
    "zero": [
        "ZeRO removes the copies that data parallelism keeps on {each} rank.",
        "consider {pw} data parallel ranks and the memory that each of them holds.",
        "here is what the three stages of ZeRO shard.",
    ],
    "collectives": [
        "a collective is a pattern of messages between ranks.",
        "consider a ring of {p} ranks, where rank {r} talks to rank {right}.",
        "here is how an all-reduce is built from sends and receives.",
    ],
    "model": [
        "the model is a small GPT with {L} layers.",
        "consider a GPT with {L} layers, {h} heads and a width of {C}.",
        "here is what happens to a token inside the model.",
    ],
    "training": [
        "a training step has three parts: forward, backward and update.",
        "consider a run with a learning rate of {lr} and {warm} steps of warm-up.",
        "here is what the trainer does in one step.",
    ],
}

_BODY = {
    "pipeline": [
        "stage {s} {sends} its activations to stage {s1}.",
        "stage {s1} {sends} the gradients back to stage {s}.",
        "the first stage reads the tokens, and the last stage computes the loss.",
        "the first stage {sends} activations to the next stage, and the next stage {sends} gradients back.",
        "with {m} micro-batches and {p} stages, {each} stage waits for {idle} of {slots} time slots.",
        "more micro-batches make the bubble smaller, but {each} micro-batch does less work.",
        "in the warm-up phase, {each} stage runs forward passes until the pipeline is full.",
        "in the steady state, {each} stage runs one forward pass and {then} one backward pass.",
        "in the cool-down phase, the stages finish the backward passes that are left.",
        "a stage that has nothing to do waits, and that idle time is called the bubble.",
        "the schedule is a list of instructions: forward, send, receive and backward.",
        "GPipe runs all the forward passes first, so it keeps the activations of all {m} micro-batches.",
        "the 1F1B schedule keeps at most {p} micro-batches of activations on the first stage.",
        "the last stage starts its backward pass as soon as the first micro-batch arrives.",
        "if stage {s1} is {slow}, stage {s} waits before it can send the next micro-batch.",
        "why does the first stage wait at the end? Because the gradients come back from the last stage.",
        "stage {last} holds the last layers and the loss, and stage 0 holds the embedding.",
        "the pipeline sends only activations and gradients, never the weights.",
    ],
    "data": [
        "{each} rank reads a different part of the batch and runs the same model on it.",
        "a global batch of {B} sequences on {p} ranks gives {each} rank {per} sequences.",
        "after the backward pass, the ranks average their gradients with an all-reduce.",
        "rank {r} computes the gradients of its {per} sequences, and the all-reduce adds the gradients of the others.",
        "because {each} rank applies the same update, the copies of the model stay identical.",
        "the gradients are sent in buckets of {mb} megabytes, so the messages overlap with the backward pass.",
        "if one rank is {slow}, the others wait for it in the all-reduce.",
        "a rank can split its {per} sequences into four micro-batches of {micro} and add up the gradients.",
        "the loss is the same as on one process, because the mean over the global batch does not change.",
        "why do the copies stay the same? Because {each} rank starts from the same weights and applies the "
        "same update.",
        "data parallelism saves time, but not memory: {each} rank still holds the whole model.",
        "the test compares the loss of {p} ranks with the loss of one process, to twelve digits.",
    ],
    "tensor": [
        "the {linear} splits its weight by columns, so {each} rank computes part of the output.",
        "each of the {t} ranks computes {hpr} of the {h} attention heads.",
        "the first MLP layer is split by columns and the second by rows, so one all-reduce is enough.",
        "a weight of shape ({C}, {C4}) becomes a slice of shape ({C}, {Ct}) on {each} rank.",
        "megatron's f is the identity in the forward pass and an all-reduce in the backward pass.",
        "megatron's g is an all-reduce in the forward pass and the identity in the backward pass.",
        "tensor parallel ranks talk after {each} layer, so they should sit on the same machine.",
        "rank {r} holds its own slice of {each} weight and never sees the rest.",
        "the output of a row parallel layer is a sum, so the ranks add their parts with an all-reduce.",
        "why split the heads? Because {each} head can be computed without the others.",
        "the layer norms are not split: {each} rank keeps a full copy of them.",
        "the embedding can be split by rows of the vocabulary, with an all-reduce after the lookup.",
    ],
    "zero": [
        "ZeRO stage one shards the optimizer state across the data parallel ranks.",
        "ZeRO stage two also shards the gradients, and stage three shards the weights too.",
        "with {p} ranks, {each} rank keeps {frac} of the Adam moments.",
        "the reduce-scatter leaves {each} rank with the sum of its own shard of the gradients.",
        "{each} rank updates only its shard, and {then} an all-gather brings the full weights back.",
        "before a layer runs, stage three gathers its weights, and after the layer it frees them again.",
        "the memory saved is paid for with more messages.",
        "a reduce-scatter and an all-gather move the same bytes as one all-reduce.",
        "with ZeRO stage {zero_stage}, the model still learns exactly what it learns on one process.",
        "why shard the optimizer? Because Adam keeps two numbers for {each} weight.",
        "rank {r} owns shard {r} of {p}, and no other rank updates it.",
    ],
    "collectives": [
        "in a ring of {p} ranks, the all-reduce takes {ring_steps} steps, and {each} step moves one chunk.",
        "an all-reduce of {n} bytes over {p} ranks sends {sent} bytes from {each} rank.",
        "rank {r} sends to rank {right} and receives from rank {left}.",
        "a reduce-scatter followed by an all-gather is an all-reduce.",
        "for small messages, recursive doubling is {fast}, because it needs only {rounds}.",
        "for large messages, the ring wins, because {each} link is busy at {each} step.",
        "the tree broadcast reaches {p} ranks in {rounds}.",
        "the all-gather in a ring takes {gather_steps} steps, and {each} step moves a chunk of {chunk} bytes.",
        "{each} message is counted, so the ledger can tell how many bytes the {coll} sent.",
        "a receive that waits too long gives up and names the step and the peer.",
        "the {coll} is built from sends and receives, never from the collectives of MPI.",
        "why is the ring {fast} for big messages? Because no rank sends more than twice its data.",
    ],
    "model": [
        "{each} token becomes a vector of width {C}, plus a vector for its position.",
        "{each} block normalises its input, mixes the tokens with attention, and {then} runs a small MLP.",
        "attention lets {each} token look back at the tokens before it, but never ahead.",
        "the residual stream carries the signal from the embedding to the last layer.",
        "the MLP widens {each} token from {C} to {C4} and {then} brings it back to {C}.",
        "the last layer turns {each} vector into 256 scores, one for {each} byte.",
        "the model reads bytes, so it has to learn words from letters.",
        "with {h} heads, {each} head looks at a different pattern in the text.",
        "the weights start small and random, and the same seed gives the same weights.",
        "the embedding and the output layer share one matrix.",
        "a model of {L} layers on {p} stages puts {per_stage} layers on {each} stage.",
    ],
    "training": [
        "at step {step}, the loss is {loss}, and the learning rate is {lr}.",
        "the loss is the mean cross-entropy over {each} position of the global batch.",
        "the model predicts the next byte at {each} position of a block of {T} tokens.",
        "a batch of {B} sequences of {T} tokens holds {tokens} tokens.",
        "the backward pass computes a gradient for {each} weight.",
        "AdamW keeps two moments for {each} weight: the mean of the gradient and the mean of its square.",
        "the gradients are clipped when their norm is larger than {clip}.",
        "the learning rate warms up for {warm} steps and {then} decays slowly.",
        "the checkpoint stores the weights, the optimizer state and the step.",
        "a run can stop at step {step} and resume on another layout, as if it never stopped.",
        "the loss falls quickly at first and {then} more slowly.",
        "why does the loss fall? Because {each} update moves the weights against the gradient.",
        "the trainer prints the loss, the tokens per second and the bytes sent at {each} step.",
    ],
}

_TOPICS = list(_INTROS)  # dict order is insertion order, the same on every Python >= 3.7


def _sentence(template, rng, paragraph):
    text = template.format_map(_Fill(rng, paragraph))
    return text[0].upper() + text[1:]


def generate(target_bytes=TARGET_BYTES, seed=SEED):
    """The corpus: paragraphs of one intro and 3 to 6 body sentences, until target_bytes."""
    rng = _Lcg(seed)
    paragraphs, size = [], 0
    while size < target_bytes:
        topic = rng.choice(_TOPICS)
        body = _BODY[topic]
        numbers = _Fill(rng)  # this paragraph's p, m, B, ... drawn on first use
        sentences = [_sentence(rng.choice(_INTROS[topic]), rng, numbers)]
        picked = []
        for _ in range(3 + rng.below(4)):  # 3 to 6 different body sentences
            i = rng.below(len(body))
            while i in picked:
                i = (i + 1) % len(body)
            picked.append(i)
            sentences.append(_sentence(body[i], rng, numbers))
        paragraphs.append(" ".join(sentences))
        size += len(paragraphs[-1]) + 2
    return "\n\n".join(paragraphs) + "\n"
