"""The State Descriptor of each reference-model variant, built with :mod:`nexuskv.models`.

Everything that makes state of one runtime unusable by another is in the descriptor's
compatibility fields, so the two get different descriptor ids and
:func:`nexuskv.dataplane.guard.loadable` names the field that differs:

* the variant (GQA: key/value groups; MLA: latent and RoPE-key group; hybrid: an attention group
  and a recurrent checkpoint group), and the weights (``model_revision`` = the spec's digest);
* the cache dtype, the block size, the layers each group covers, the checkpoint interval.

The physical layout is the runtime's page: per block, ``[layer, token, row]`` with a row being
the concatenated tensors of the group in descriptor order (``ref_page_layer_token``); a
checkpoint is ``[layer, recurrent state | conv state]``.
"""

from __future__ import annotations

from nexuskv.descriptor import StateDescriptor
from nexuskv.models import gqa_descriptor, hybrid_descriptor, mla_descriptor
from nexuskv.reference_engine.spec import ReferenceModelSpec, Variant

__all__ = ["ENGINE_FAMILY", "LAYOUT", "descriptor_for", "tokenizer_revision"]

ENGINE_FAMILY = "nexuskv-reference"
LAYOUT = "ref_page_layer_token"


def tokenizer_revision(spec: ReferenceModelSpec) -> str:
    """The reference model reads token ids directly; its "tokenizer" is the id range."""
    return f"ids-{spec.vocab_size}"


def descriptor_for(spec: ReferenceModelSpec, *, tenant_namespace: str = "default") -> StateDescriptor:
    common = dict(model=spec.model_name, model_revision=spec.revision, tokenizer_revision=tokenizer_revision(spec),
                  engine_family=ENGINE_FAMILY, tenant_namespace=tenant_namespace, block_size=spec.block_size,
                  dtype=spec.kv_dtype, rope_theta=spec.rope_theta, layout=LAYOUT)
    if spec.variant is Variant.GQA:
        return gqa_descriptor(num_layers=spec.n_layers, num_kv_heads=spec.n_kv_heads, head_dim=spec.head_dim,
                              **common)
    if spec.variant is Variant.MLA:
        return mla_descriptor(num_layers=spec.n_layers, kv_lora_rank=spec.kv_lora_rank,
                              rope_head_dim=spec.qk_rope_dim, **common)
    return hybrid_descriptor(attention_layers=spec.attention_layers, recurrent_layers=spec.recurrent_layers,
                             num_kv_heads=spec.n_kv_heads, head_dim=spec.head_dim,
                             recurrent_state_shape=spec.recurrent_state_shape, conv_state_shape=spec.conv_state_shape,
                             checkpoint_interval=spec.checkpoint_interval, **common)
