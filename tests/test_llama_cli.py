"""--arch llama from the command line, as a user runs it: --verify in float64 on layouts that
cross every split of the family (shared key/value heads under tp, sequence parallelism with
RMSNorm, the ring with grouped-query attention, pipelines, ZeRO), the one-line refusals of its
flags, and checkpoints that refuse the other family. scripts/verify_matrix.py holds the rest."""
import pytest

from minipar.config import flags as config
from minipar.model.config import GPTConfig
from test_checkpoint_layouts import ok
from test_failing_cleanly import run_driver
from minipar.train import trainer as train
from trainer_runs import assert_main_exits_2, mpirun, run_tiny

pytestmark = pytest.mark.usefixtures("fixed_peak")
LLAMA = ["--arch", "llama", "--n-head", "4", "--n-embd", "16", "--ffn-hidden", "24", "--rope-theta", "500",
         "--dtype", "float64"]


def verified(p, layout):
    lines = [line for line in p.stdout.splitlines() if line.startswith("verify: dp=")]
    assert p.returncode == 0 and len(lines) == 1 and lines[0].endswith("-> OK"), (layout, p.stdout + p.stderr)
    return lines[0]


@pytest.mark.parametrize("layout", [
    ["--n-kv-head", "1", "--dp", "2", "--tp", "2", "--zero", "2"],                 # one KV head on both tp ranks
    ["--n-kv-head", "2", "--tp", "2", "--sp", "--pp", "2", "--n-layer", "2", "--micro-batches", "2"],
    ["--n-kv-head", "2", "--cp", "2", "--dp", "2", "--zero", "3", "--recompute", "selective"],
    ["--moe-experts", "4", "--moe-shared-experts", "1", "--moe-ffn-hidden", "12", "--dp", "2", "--ep", "2", "--tp", "2",
     "--recompute", "full"],
], ids=["dp2-tp2-kv1-zero2", "tp2-sp-pp2", "cp2-dp2-zero3", "mixtral-deepseek-ep2-tp2"])
def test_verify_equals_the_single_process(layout):
    verified(ok(mpirun(4, *LLAMA, *layout, "--verify", timeout=240)), layout)


def test_trains_and_says_what_it_is(capsys):
    run_tiny(*LLAMA, "--n-kv-head", "2", "--steps", "3")
    out = capsys.readouterr().out
    assert out.startswith("minipar: Llama L=1 H=4 Hkv=2 C=16 F=24 theta=500 T=16 V=256 (untied)"), out


@pytest.mark.parametrize("flags,needles", [
    (["--rope-theta", "500"], ["--rope-theta is a setting of the Llama family: it needs --arch llama"]),
    (["--n-kv-head", "1"], ["--n-kv-head is a setting of the Llama family"]),
    (["--ffn-hidden", "10"], ["--ffn-hidden 10", "GPT-2's MLP is 4 x --n-embd = 64"]),
    (["--arch", "llama", "--n-head", "4", "--n-kv-head", "3"], ["--n-kv-head 3 must divide --n-head 4"]),
    (["--arch", "llama", "--n-embd", "18", "--n-head", "2"], ["head size", "must be even"]),
    (["--arch", "llama", "--norm-eps", "0"], ["--norm-eps must be > 0, got 0.0"]),
    (["--arch", "llama", "--rope-theta", "nan"], ["--rope-theta must be a finite number, got nan"]),
    (["--arch", "llama", "--multiple-of", "0"], ["--multiple-of 0 must be >= 1"]),
    (["--arch", "llama", "--ffn-hidden", "-4"], ["--ffn-hidden -4 must be >= 1"]),
    (["--moe-experts", "2", "--moe-shared-experts", "1"], ["--moe-shared-experts is a setting of the Llama family"]),
    (["--moe-router", "mixtral"], ["--moe-router is for a mixture of experts: it needs --moe-experts > 0"]),
])
def test_bad_family_flags_are_one_line_errors(flags, needles, capsys):
    assert_main_exits_2(["--n-embd", "16", "--block-size", "16", *flags], needles, capsys, flags)


@pytest.mark.parametrize("flags,needle", [(["--arch", "gpt3"], "argument --arch: invalid choice: 'gpt3'"),
                                          (["--tied", "--untied"], "argument --untied: not allowed with argument --tied")])
def test_flags_argparse_refuses(flags, needle, capsys):
    with pytest.raises(SystemExit) as e:
        train.main(flags)
    err = capsys.readouterr().err
    assert e.value.code == 2 and needle in err.splitlines()[-1], err


FORGET_THE_COUNTS = """
from minipar.parallel.pipeline import stage
def take_counts(self, key, mb):
    if self.pooled:
        self.model.moe.use_pool(mb)
        self.counts.pop(key, None)                   # the neighbour's counts, dropped
stage.PipelineEngine.take_counts = take_counts
"""


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_mixtrals_pooled_loss_crosses_the_pipeline_stages(schedule, tmp_path):
    """Mixtral's loss pools every MoE block's counts: on a pipeline they travel beside each
    activation (the blocks before) and each gradient (the whole model's), and --verify equals
    one process. Planted: a stage that drops what it receives (each stage pooling only its
    own blocks) is caught by --verify."""
    flags = [*LLAMA, "--n-layer", "2", "--moe-experts", "4", "--moe-aux-coef", "0.5", "--dp", "2", "--pp", "2",
             "--micro-batches", "2", "--schedule", schedule, "--verify"]
    verified(ok(mpirun(4, *flags, timeout=240)), flags)
    p = run_driver(tmp_path, 4, FORGET_THE_COUNTS, *flags)
    lines = [line for line in p.stdout.splitlines() if line.startswith("verify: dp=")]
    assert p.returncode == 1 and len(lines) == 1 and "-> FAILED" in lines[0], p.stdout[-2000:] + p.stderr[-2000:]


def test_tensor_parallelism_refuses_an_mlp_width_it_cannot_split():
    """An MLP of F columns on tp ranks: F/tp each, or one line (else columns would be dropped)."""
    with pytest.raises(config.ConfigError, match="the MLP's width 40 .* is not divisible by --tp 3"):
        config.check_split(GPTConfig(arch="llama", n_head=6, n_embd=24, ffn_hidden=40), 1, 3, 1, 6, 1)


def test_tensor_parallelism_refuses_kv_heads_it_cannot_place():
    cfg = GPTConfig(arch="llama", n_head=6, n_kv_head=3, n_embd=24, ffn_hidden=48)
    with pytest.raises(config.ConfigError, match="--n-kv-head 3 and --tp 2"):
        config.check_split(cfg, 1, 2, 1, 4, 1)
    for tp in (1, 3, 6):                                          # 3 divides tp, or tp divides 3
        config.check_split(GPTConfig(arch="llama", n_head=6, n_kv_head=3, n_embd=24, ffn_hidden=48), 1, tp, 1, 4, 1)


def test_a_checkpoint_refuses_the_other_family(tmp_path, capsys):
    d = str(tmp_path / "ck")
    run_tiny(*LLAMA, "--n-kv-head", "2", "--steps", "2", "--save", d)
    capsys.readouterr()
    assert_main_exits_2(["--n-embd", "16", "--block-size", "16", "--resume", d, "--arch", "gpt2", "--steps", "3"],
                        ["--arch gpt2 does not match the checkpoint", "(arch = llama)"], capsys, "arch")
    run_tiny("--resume", d, "--n-head", "4", "--dtype", "float64", "--steps", "3") # without --arch: the checkpoint's family
    assert "minipar: Llama" in capsys.readouterr().out
