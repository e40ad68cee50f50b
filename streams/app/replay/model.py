"""Random Llama checkpoints written locally, for engines to serve when no model is given.

No model hub is reachable where NexusKV is tested, and the replay measures serving, not quality:
a random model with a real architecture costs vLLM exactly what a trained one of that shape
would. :data:`SIZES` names two shapes: ``tiny`` (tests: starts in seconds) and ``replay`` (the
default of ``nexuskv replay``: sized so that prefill dominates TTFT on a two-core machine, about
a second for a 2K-token prompt on one core). The tokenizer is an offline word-level one over the
vocabulary (``t0`` ... ``t1023``); replays send token ids, never text.

A checkpoint is written once per shape under the given folder and reused (safetensors, bf16).
``transformers`` and ``tokenizers`` come with vLLM.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["ModelShape", "SIZES", "random_llama"]


@dataclass(frozen=True, slots=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int = 1024
    max_positions: int = 8192
    seed: int = 0

    @property
    def digest(self) -> str:
        return hashlib.blake2b(json.dumps(asdict(self), sort_keys=True).encode(), digest_size=5).hexdigest()


SIZES: dict[str, ModelShape] = {
    "tiny": ModelShape(hidden=128, layers=2, heads=4, kv_heads=2, intermediate=256),
    "replay": ModelShape(hidden=512, layers=8, heads=8, kv_heads=4, intermediate=1408),
}


def random_llama(root: Path, shape: ModelShape) -> Path:
    """The folder of a random Llama of ``shape`` under ``root`` (written on first use)."""
    out = Path(root) / f"llama-random-{shape.digest}"
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tmp = out.with_name(out.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                         num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                         num_key_value_heads=shape.kv_heads, max_position_embeddings=shape.max_positions,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
                         torch_dtype="bfloat16")
    torch.manual_seed(shape.seed)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True)
    words = {f"t{i}": i for i in range(shape.vocab)}
    tokenizer = Tokenizer(models.WordLevel(vocab=words, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", bos_token="t1", eos_token="t2",
                            pad_token="t0").save_pretrained(tmp)
    tmp.rename(out)
    return out
