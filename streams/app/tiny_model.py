"""A tiny random Llama in a local folder, for running real engines where no model hub is reachable.

:func:`build_tiny_llama` writes what an engine loads from a folder: ``config.json`` (a Llama with
2 layers, hidden size 128, 4 attention heads, 2 KV heads, a 1,024-word vocabulary, bfloat16),
``model.safetensors`` with random weights from a fixed seed, and an offline word-level tokenizer
(``tokenizer.json`` with its config): the words ``w0`` ... ``w1019`` split on whitespace, plus
four special tokens. The weights are random, so the model's text means nothing, but every engine
computes real attention over a real paged KV cache with it, and the same seed gives the same
weights, hence the same greedy tokens and logprobs from run to run.

Why here (the composition root's package): the tests of the engine adapters and NexusKV's own
commands that start engines (a replay against vLLM) both build it, and neither may make the other
import it across the layers (``streams`` never imports ``connectors``). It needs ``transformers``,
``tokenizers`` and ``safetensors``, which the vLLM install (``infra/engines/install_vllm.sh``)
brings; they are imported only when a model is built.

:func:`prompt` turns word numbers into the text this tokenizer maps one to one onto token ids
(``prompt([5, 6])`` is ``"w5 w6"``, ids ``[9, 10]``: the special tokens come first), so a test can
choose exact token sequences and block boundaries.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["TinyLlamaSpec", "build_tiny_llama", "prompt", "SPECIAL_TOKENS", "word_id"]

#: Special tokens, ids 0..3, in this order.
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")
_MARK = "nexuskv-tiny-model.json"


@dataclass(frozen=True, slots=True)
class TinyLlamaSpec:
    """The model's shape. Defaults: 2 layers, hidden 128, 4 heads, 2 KV heads, vocab 1,024, bf16."""

    num_layers: int = 2
    hidden_size: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    vocab_size: int = 1024
    intermediate_size: int = 256
    max_positions: int = 4096
    dtype: str = "bfloat16"
    rope_theta: float = 10000.0
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def words(self) -> int:
        return self.vocab_size - len(SPECIAL_TOKENS)

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


def word_id(word: int) -> int:
    """The token id of word number ``word`` (``w<word>``)."""
    return len(SPECIAL_TOKENS) + word


def prompt(words: Sequence[int]) -> str:
    """The text whose tokens are exactly ``[word_id(w) for w in words]`` (no BOS is added)."""
    return " ".join(f"w{w}" for w in words)


def build_tiny_llama(folder: Path | str, spec: TinyLlamaSpec = TinyLlamaSpec()) -> Path:
    """Write the model to ``folder`` (created) and return it; a folder already holding ``spec`` is kept."""
    out = Path(folder)
    mark = out / _MARK
    if mark.is_file() and json.loads(mark.read_text()).get("digest") == spec.digest():
        return out
    out.mkdir(parents=True, exist_ok=True)
    _write_model(out, spec)
    _write_tokenizer(out, spec)
    mark.write_text(json.dumps({"digest": spec.digest(), "spec": asdict(spec)}, indent=1))
    return out


def _write_model(out: Path, spec: TinyLlamaSpec) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim, max_position_embeddings=spec.max_positions,
        rope_theta=spec.rope_theta, bos_token_id=1, eos_token_id=2, pad_token_id=3, tie_word_embeddings=False,
        torch_dtype=spec.dtype,
    )
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(spec.seed)
        model = LlamaForCausalLM(config).to(getattr(torch, spec.dtype))
    finally:
        torch.random.set_rng_state(generator_state)
    model.save_pretrained(out, safe_serialization=True)


def _write_tokenizer(out: Path, spec: TinyLlamaSpec) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({f"w{w}": word_id(w) for w in range(spec.words)})
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", model_max_length=spec.max_positions)
    fast.save_pretrained(out)
