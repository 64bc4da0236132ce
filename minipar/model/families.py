"""The model families by arch: GPTConfig.family looks them up here."""
from minipar.model import gpt, llama

FAMILIES = {gpt.FAMILY.name: gpt.FAMILY, llama.FAMILY.name: llama.FAMILY}
