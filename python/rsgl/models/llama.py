"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2) over a paged KV cache."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from rsgl.layers import decode_stack
from rsgl.layers.attention.base import AttentionBackend
from rsgl.layers.attention.torch_native import TorchNativeAttnBackend
from rsgl.layers.cpu_kernels import ACT_DTYPES, QUANT_BLOCK, CpuKernels, load_cpu_kernels
from rsgl.layers.linear import PackedLinear, can_pack, pack_linears
from rsgl.layers.norm import RMSNorm
from rsgl.layers.parallel import RowParallelLinear, VocabParallelEmbedding
from rsgl.layers.quant_linear import (
    GGUFBlocks,
    GroupQuantized,
    LoadedWeight,
    LowBitWeight,
    QuantLinear,
)
from rsgl.layers.rotary import RotaryEmbedding, apply_rotary, interleave_rotary_pairs
from rsgl.models.config import ModelConfig

if TYPE_CHECKING:
    from rsgl.distributed.group import TPRank
    from rsgl.model_executor.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)

# HF checkpoint projection name -> (fused parameter, shard index).
_FUSED_SHARDS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}

# On CPU a long extend runs the MLP this many rows at a time, so that its widest
# intermediate (gate_up: rows x 2 intermediate) stays in cache instead of making a round
# trip through memory, freshly page-faulted every layer (SmolLM2 prefill of 6,400 tokens
# on 2 cores: float32 5.06 -> 4.33 s, bfloat16 1.42 -> 1.33 s).
MLP_CPU_CHUNK = 512

# Fused parameter -> the checkpoint projections it is made of, in order.
_PARTS: dict[str, tuple[str, ...]] = {
    fused: tuple(hf for hf, (f, _) in _FUSED_SHARDS.items() if f == fused)
    for fused, _ in _FUSED_SHARDS.values()
}

# Tensors whose rows are permuted so rotary pairs are adjacent (see rsgl.layers.rotary).
_PAIR_INTERLEAVED = (".q_proj.", ".k_proj.", ".q_norm.", ".k_norm.")


class LlamaAttention(nn.Module):
    """Fused QKV projection, optional q/k RMSNorm (Qwen3), rotary, backend attention, o_proj.

    On CUDA the rotary is one Triton kernel that rotates q and k in place in the projection's
    output (`rsgl.layers.triton_kernels`), unless `use_triton` is off.

    Under tensor parallelism (`tp`) the layer holds its rank's query and KV heads only (the
    QKV projection is column-parallel) and o_proj is row-parallel: its all-reduce gives every
    rank the whole attention output.
    """

    def __init__(self, config: ModelConfig, layer_id: int, tp: TPRank | None = None) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_attention_heads if tp is None else tp.shard.num_heads
        self.num_kv_heads = config.num_key_value_heads if tp is None else tp.shard.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias
        )
        self.o_proj: nn.Linear | RowParallelLinear
        if tp is None:
            self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        else:
            self.o_proj = RowParallelLinear(
                self.q_size, config.hidden_size, config.o_bias, tp.group
            )
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.use_triton = True

    def shard_sizes(self) -> list[int]:
        return [self.q_size, self.kv_size, self.kv_size]

    def forward(
        self,
        hidden: torch.Tensor,
        cis: torch.Tensor,
        batch: ForwardBatch,
        attn: AttentionBackend,
    ) -> torch.Tensor:
        t, heads, kv_heads, dim = hidden.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(hidden)
        if self.q_norm is None:
            fused = attn.forward_decode_qkv(qkv, cis, self.layer_id, batch)
            if fused is not None:
                decoded: torch.Tensor = self.o_proj(fused)
                return decoded
        v = qkv[:, self.q_size + self.kv_size :].view(t, kv_heads, dim)
        if qkv.is_cuda and self.use_triton:
            from rsgl.layers import triton_kernels

            if self.q_norm is not None and self.k_norm is not None:
                q = self.q_norm(qkv[:, : self.q_size].view(t, heads, dim))
                k = self.k_norm(
                    qkv[:, self.q_size : self.q_size + self.kv_size].view(t, kv_heads, dim)
                )
                triton_kernels.rotary_qk(q, cis)
                triton_kernels.rotary_qk(k, cis)
            else:
                # Rotated in place: the projection's output is this layer's own buffer.
                qk = qkv[:, : self.q_size + self.kv_size].view(t, heads + kv_heads, dim)
                triton_kernels.rotary_qk(qk, cis)
                q, k = qk[:, :heads], qk[:, heads:]
        elif self.q_norm is not None and self.k_norm is not None:
            q = apply_rotary(self.q_norm(qkv[:, : self.q_size].view(t, heads, dim)), cis)
            k = self.k_norm(qkv[:, self.q_size : self.q_size + self.kv_size].view(t, kv_heads, dim))
            k = apply_rotary(k, cis)
        else:
            # q and k are adjacent in the fused output: rotate both in one op (on CPU one C
            # kernel, in place: the projection's output is this layer's own buffer).
            kernels = load_cpu_kernels() if qkv.device.type == "cpu" else None
            qk = qkv[:, : self.q_size + self.kv_size].view(t, heads + kv_heads, dim)
            if kernels is not None and qkv.dtype in ACT_DTYPES and qkv.is_contiguous():
                kernels.rotary_qk(qkv, torch.view_as_real(cis), heads + kv_heads, dim)
            else:
                qk = apply_rotary(qk, cis)
            q, k = qk[:, :heads], qk[:, heads:]
        out: torch.Tensor = self.o_proj(attn.forward(q, k, v, self.layer_id, batch))
        return out


class LlamaMLP(nn.Module):
    """SwiGLU with the gate and up projections fused into one matmul; the activation is one
    fused kernel on CPU in float32 or bfloat16 (C) and on CUDA (Triton, unless `use_triton`
    is off). Under tensor parallelism (`tp`) the layer holds its rank's range of the
    intermediate units: gate_up is column-parallel, down_proj row-parallel."""

    def __init__(self, config: ModelConfig, tp: TPRank | None = None) -> None:
        super().__init__()
        size = config.intermediate_size if tp is None else len(tp.shard.intermediate)
        self.intermediate_size = size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * size, bias=False)
        self.down_proj: nn.Linear | RowParallelLinear
        if tp is None:
            self.down_proj = nn.Linear(size, config.hidden_size, bias=False)
        else:
            self.down_proj = RowParallelLinear(size, config.hidden_size, False, tp.group)
        self.use_triton = True

    def shard_sizes(self) -> list[int]:
        return [self.intermediate_size, self.intermediate_size]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if x.device.type == "cpu" and rows > 2 * MLP_CPU_CHUNK:
            return torch.cat(
                [self._forward(x[i : i + MLP_CPU_CHUNK]) for i in range(0, rows, MLP_CPU_CHUNK)]
            )
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        kernels = load_cpu_kernels() if gate_up.device.type == "cpu" else None
        if gate_up.is_cuda and self.use_triton:
            from rsgl.layers import triton_kernels

            act = triton_kernels.silu_mul(gate_up)
        elif kernels is not None and gate_up.dtype in ACT_DTYPES:
            act = kernels.silu_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate) * up
        out: torch.Tensor = self.down_proj(act)
        return out


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks with residual connections."""

    def __init__(self, config: ModelConfig, layer_id: int, tp: TPRank | None = None) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, tp)
        self.mlp = LlamaMLP(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cis: torch.Tensor,
        batch: ForwardBatch,
        attn: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this block's MLP output, the residual stream before adding it); the next
        norm adds the two, so each residual add is fused into a norm."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.add_forward(hidden, residual)
        hidden = self.self_attn(hidden, cis, batch, attn)
        hidden, residual = self.post_attention_layernorm.add_forward(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm (HF's `model.` prefix)."""

    def __init__(self, config: ModelConfig, tp: TPRank | None = None) -> None:
        super().__init__()
        self.embed_tokens: nn.Embedding | VocabParallelEmbedding
        if tp is None:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        else:
            self.embed_tokens = VocabParallelEmbedding(tp.shard.vocab, config.hidden_size, tp.group)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, tp) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM; `forward` returns logits for each request's last position.

    Parameter names follow HF checkpoints (`model.layers.N....`, `lm_head`) except that q/k/v
    and gate/up are fused; `load_weights` maps checkpoint tensors onto the fused shards.

    With `tp` (tensor parallelism) the model is one rank's shard (`rsgl.distributed.sharding`):
    `load_weights` reads the whole checkpoint and keeps the rank's rows and columns, the LM
    head computes the rank's vocabulary slice and the logits are all-gathered, so every rank
    returns the same full logits and samples the same tokens.
    """

    def __init__(self, config: ModelConfig, max_positions: int, tp: TPRank | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.model = LlamaModel(config, tp)
        self.lm_head: nn.Linear | None = None
        if not config.tie_word_embeddings:
            vocab = config.vocab_size if tp is None else len(tp.shard.vocab)
            self.lm_head = nn.Linear(config.hidden_size, vocab, bias=False)
        # Set by pack_cpu_weights: the LM head in oneDNN's layout. It replaces an untied head;
        # a tied one is also the embedding, whose plain copy stays for lookups.
        self.packed_lm_head: PackedLinear | None = None
        # Set by use_gguf_blocks / quantize_weights: the LM head in low-bit form, read by
        # small batches.
        self.low_bit_lm_head: QuantLinear | None = None
        self.rotary = RotaryEmbedding(config.head_dim, max_positions, config.rope)
        # The decode stack for the attention backend and activation dtype of `_stack_key`.
        self._stack_key: tuple[int, torch.dtype] | None = None
        self._stack: _Stack | None = None

    @property
    def layers(self) -> list[LlamaDecoderLayer]:
        return [layer for layer in self.model.layers if isinstance(layer, LlamaDecoderLayer)]

    def lm_head_weight(self) -> torch.Tensor:
        """The plain LM head matrix (the embedding when tied)."""
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.weight
        if self.lm_head is None:
            raise RuntimeError("the LM head was packed for oneDNN; use compute_logits")
        return self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor, gather: bool = True) -> torch.Tensor:
        """[B, hidden] final-normed states -> [B, vocab] logits. Under tensor parallelism
        without `gather`: this rank's vocabulary slice only ([B, len(tp.shard.vocab)])."""
        head = self.low_bit_lm_head
        if head is not None and head.serves(hidden.shape[0]):
            logits: torch.Tensor = head(hidden)
        elif self.packed_lm_head is not None:
            logits = self.packed_lm_head(hidden)
        else:
            logits = F.linear(hidden, self.lm_head_weight())
        if self.tp is not None and gather:
            return self.tp.group.all_gather(logits, self.tp.shard.vocab_sizes)
        return logits

    def set_triton_kernels(self, enabled: bool) -> None:
        """Turn the CUDA path's fused Triton kernels (norms, SwiGLU, rotary) on or off; off
        runs the eager torch ops, to compare against."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, LlamaAttention, LlamaMLP)):
                module.use_triton = enabled

    def pack_cpu_weights(self) -> None:
        """Reorder every projection and the LM head into oneDNN's layout (float32 or bfloat16
        on CPU; see rsgl.layers.linear). The last step of loading: `load_weights` refuses
        after it."""
        if self.packed_lm_head is not None or not can_pack(self.model.embed_tokens.weight):
            return
        pack_linears(self.model)
        for module in self.model.modules():
            if isinstance(module, RowParallelLinear):
                module.pack()
        self.packed_lm_head = PackedLinear(self.lm_head_weight(), None)
        self.lm_head = None

    def _projections(self) -> Iterator[tuple[nn.Module, str, str]]:
        """(owner, attribute, HF name prefix) of every dense projection, fused ones by
        their fused name (`model.layers.3.self_attn.qkv_proj`); row-parallel ones too."""
        for i, layer in enumerate(self.layers):
            for owner, attr, path in (
                (layer.self_attn, "qkv_proj", "self_attn.qkv_proj"),
                (layer.self_attn, "o_proj", "self_attn.o_proj"),
                (layer.mlp, "gate_up_proj", "mlp.gate_up_proj"),
                (layer.mlp, "down_proj", "mlp.down_proj"),
            ):
                if isinstance(getattr(owner, attr), (nn.Linear, RowParallelLinear)):
                    yield owner, attr, f"model.layers.{i}.{path}"

    def _check_low_bit(self) -> None:
        if self.packed_lm_head is not None:
            raise ValueError("low-bit weights are set up before the weights are packed")

    @staticmethod
    def _install(owner: nn.Module, attr: str, weight: LowBitWeight, max_rows: int) -> None:
        """Give projection `owner.attr` low-bit weights for batches of up to `max_rows`."""
        dense = getattr(owner, attr)
        if isinstance(dense, RowParallelLinear):
            # The bias is added after the all-reduce, by the row-parallel layer.
            dense.low_bit = QuantLinear(weight, max_rows=max_rows)
        else:
            setattr(owner, attr, QuantLinear(weight, dense, dense.bias, max_rows))

    def _rank_blocks(self, name: str, blocks: LoadedWeight) -> LoadedWeight:
        """This rank's part of checkpoint matrix `name` in low-bit form: whole blocks of 32
        input columns (whole groups), so a column split must fall on a block boundary."""
        rows, k = blocks.shape
        if isinstance(blocks, GGUFBlocks):
            view = blocks.data.view(rows, k // QUANT_BLOCK, -1)
            part = self._rank_slice(name, view, column_unit=QUANT_BLOCK)
            return dataclasses.replace(blocks, data=part.reshape(part.shape[0], -1).contiguous())

        # Whole groups, and whole blocks: int8 groups of 16 (Q6_K's) split two to a block.
        unit = max(blocks.group, QUANT_BLOCK)

        def split(t: torch.Tensor) -> torch.Tensor:
            part = self._rank_slice(name, t.view(rows, k // unit, -1), unit)
            return part.reshape(part.shape[0], -1).contiguous()

        mins = None if blocks.mins is None else split(blocks.mins)
        return dataclasses.replace(
            blocks, q=split(blocks.q), scales=split(blocks.scales), mins=mins
        )

    @torch.no_grad()
    def use_gguf_blocks(
        self,
        blocks: Mapping[str, LoadedWeight],
        max_rows: int,
        blocks_max_rows: int | None = None,
    ) -> int:
        """Serve the projections and the LM head from a GGUF file's own blocks (HF names ->
        `GGUFBlocks`, or K-quants' groups: `rsgl.models.gguf_weights.read_blocks`) for
        batches of up to `max_rows` rows (`blocks_max_rows`, where given, for GGUF's blocks
        and `max_rows` for the groups: `low_bit_max_rows`' `interleaved`); the dense
        weights (the same numbers) stay for larger ones. A fused projection needs all of its
        parts in one form; matrices whose blocks are missing stay dense. Call after
        `load_weights` and before `pack_cpu_weights`. Returns how many matrices read blocks.

        The blocks must hold the loaded weights exactly: three rows of each are rebuilt and
        compared, and a mismatch (another row order, another file) is a ValueError."""
        self._check_low_bit()
        count = 0
        for owner, attr, name in self._projections():
            base, fused = name.rsplit(".", 1)
            parts = [f"{base}.{hf}.weight" for hf in _PARTS.get(fused, (fused,))]
            found = [self._rank_blocks(p, blocks[p]) for p in parts if p in blocks]
            weight = _stacked(found) if len(found) == len(parts) else None
            if weight is None:
                continue
            _check_same_values(getattr(owner, attr).weight, weight)
            self._install(owner, attr, weight, _rows_for(weight, max_rows, blocks_max_rows))
            count += 1
        head_name = (
            "model.embed_tokens.weight" if self.config.tie_word_embeddings else "lm_head.weight"
        )
        if head_name in blocks:
            head = self._rank_blocks(head_name, blocks[head_name])
            _check_same_values(self.lm_head_weight(), head)
            rows = _rows_for(head, max_rows, blocks_max_rows)
            self.low_bit_lm_head = QuantLinear(head, max_rows=rows)
            count += 1
        return count

    @torch.no_grad()
    def quantize_weights(
        self,
        kernels: CpuKernels,
        bits: int,
        group: int | None,
        max_rows: int,
    ) -> int:
        """Quantize every projection to `bits` (8: symmetric int8, 4: asymmetric int4) in
        groups of `group` input weights (None: int8 per output channel, int4 groups of 32),
        and the LM head to int8 per channel; the dense weights are overwritten with the
        quantized values (the tied embedding too), so batches past the low-bit kernels'
        rows (`max_rows`), which use them, compute with the same numbers.
        Returns how many matrices."""
        self._check_low_bit()
        count = 0
        for owner, attr, _ in self._projections():
            dense = getattr(owner, attr)
            k = dense.weight.shape[1]
            weight = GroupQuantized.quantize(
                kernels, dense.weight, bits, group or (k if bits == 8 else 32)
            )
            _adopt_values(dense.weight, weight)
            self._install(owner, attr, weight, max_rows)
            count += 1
        head_weight = self.lm_head_weight()
        head = GroupQuantized.quantize(kernels, head_weight, 8, head_weight.shape[1])
        _adopt_values(head_weight, head)
        self.low_bit_lm_head = QuantLinear(head, max_rows=max_rows)
        return count + 1

    def forward(
        self,
        input_ids: torch.Tensor,
        batch: ForwardBatch,
        attn: AttentionBackend,
        gather_logits: bool = True,
        all_positions: bool = False,
    ) -> torch.Tensor:
        """input_ids: [T] (placeholders already resolved) -> logits [B, vocab] (see
        `compute_logits` for `gather_logits`); with `all_positions`, [T, vocab]: every
        position's (teacher-forced evaluation)."""
        hidden = self.model.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        cis = self.rotary.cis(batch.positions)
        if not all_positions:
            normed = self._decode_stack_step(hidden, cis, batch, attn)
            if normed is not None:
                if batch.num_extends and batch.logit_rows is None:  # a prefill's last tokens
                    normed = normed[batch.last_token_index]
                return self.compute_logits(normed, gather_logits)
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, cis, batch, attn)
        # Only the positions whose logits the step needs feed the LM head.
        last = slice(None) if all_positions else batch.lm_head_rows
        assert residual is not None
        normed, _ = self.model.norm.add_forward(hidden[last], residual[last])
        return self.compute_logits(normed, gather_logits)

    def _decode_stack_step(
        self, hidden: torch.Tensor, cis: torch.Tensor, batch: ForwardBatch, attn: AttentionBackend
    ) -> torch.Tensor | None:
        """The final-normed states of every token of a small batch (each a decode row:
        `decode_stack_step`), through every layer in one C call (`rsgl.layers.decode_stack`:
        the decode kernels, the same numbers), or None where the layer-by-layer path must
        run."""
        if not isinstance(attn, TorchNativeAttnBackend):
            return None
        stack = self._decode_stack(attn, hidden.dtype)
        if stack is None or hidden.shape[0] > stack.max_rows:
            return None
        step = attn.decode_stack_step(batch)
        if step is None:
            return None
        loc, req_to_token, slots, lens = step
        flat_cis = torch.view_as_real(cis)
        return stack.stack.run(hidden.contiguous(), flat_cis, loc, req_to_token, slots, lens)

    def _decode_stack(self, attn: TorchNativeAttnBackend, act: torch.dtype) -> _Stack | None:
        """This model's decode stack over `attn`'s caches (built on first use), or None when
        some part of it is not what the driver reads: a projection that is not low-bit, a
        bias, Qwen3's q/k norms, tensor parallelism, no CPU kernels."""
        key = (id(attn), act)
        if self._stack_key == key:
            return self._stack
        self._stack_key, self._stack = key, None
        kernels = attn.decode_kernel
        config = self.config
        if kernels is None or not decode_stack.ENABLED or self.tp is not None:
            return None
        if config.qk_norm or config.qkv_bias or config.o_bias or attn.model_dtype != act:
            return None
        parts: list[decode_stack.LayerParts] = []
        max_rows: list[int] = []
        for layer in self.layers:
            attn_mod, mlp = layer.self_attn, layer.mlp
            projs: list[nn.Module] = [
                attn_mod.qkv_proj,
                attn_mod.o_proj,
                mlp.gate_up_proj,
                mlp.down_proj,
            ]
            low_bit = [p for p in projs if isinstance(p, QuantLinear) and p.bias is None]
            if len(low_bit) < len(projs):
                return None
            max_rows += [p.max_rows for p in low_bit]
            qkv, o, gate_up, down = (p.weight for p in low_bit)
            k, v, k_scales, v_scales = attn.layer_caches(layer.self_attn.layer_id)
            norms = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
            parts.append(
                decode_stack.LayerParts(*norms, qkv, o, gate_up, down, k, v, k_scales, v_scales)
            )
        shapes = decode_stack.Shapes(
            config.hidden_size,
            attn.num_heads,
            attn.num_kv_heads,
            config.head_dim,
            self.layers[0].mlp.intermediate_size,
            config.rms_norm_eps,
            attn.scale,
        )
        try:
            built = decode_stack.DecodeStack(kernels, act, parts, self.model.norm.weight, shapes)
        except ValueError as exc:
            logger.info("decoding layer by layer: %s", exc)
            return None
        self._stack = _Stack(built, min(max_rows))
        return self._stack

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named checkpoint tensors into the (fused) parameters; checks completeness."""
        if self.packed_lm_head is not None:
            raise RuntimeError("load_weights after pack_cpu_weights: load first, then pack")
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # tied: the embedding is the LM head
            if any(p in name for p in _PAIR_INTERLEAVED):
                tensor = interleave_rotary_pairs(tensor, self.config.head_dim)
            tensor = self._rank_slice(name, tensor)
            target, shard = name, -1
            for hf_name, (fused, index) in _FUSED_SHARDS.items():
                if f".{hf_name}." in name:
                    target, shard = name.replace(hf_name, fused), index
                    break
            if target not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            param = params[target]
            if shard < 0:
                if param.shape != tensor.shape:
                    raise ValueError(f"{name}: shape {tuple(tensor.shape)} != {tuple(param.shape)}")
                param.copy_(tensor)
            else:
                module_name = target.rsplit(".", 2)[0]
                module = self.get_submodule(module_name)
                assert isinstance(module, (LlamaAttention, LlamaMLP))
                sizes = module.shard_sizes()
                offset = sum(sizes[:shard])
                param.narrow(0, offset, sizes[shard]).copy_(tensor)
                target = f"{target}#{shard}"
            loaded.add(target)
        expected: set[str] = set()
        for pname in params:
            shards = 3 if "qkv_proj" in pname else 2 if "gate_up_proj" in pname else 0
            if shards:
                expected.update(f"{pname}#{i}" for i in range(shards))
            else:
                expected.add(pname)
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:4]}")

    def _rank_slice(self, name: str, tensor: torch.Tensor, column_unit: int = 1) -> torch.Tensor:
        """This rank's part of checkpoint tensor `name` (all of it without tensor
        parallelism): rows of column-parallel and vocabulary-split tensors, input columns of
        row-parallel weights. Norms and row-parallel biases are whole on every rank.
        `column_unit`: input columns per index of dim 1 (32 for GGUF blocks)."""
        if self.tp is None:
            return tensor
        shard, dim = self.tp.shard, self.config.head_dim

        def columns(r: range) -> torch.Tensor:
            if r.start % column_unit or r.stop % column_unit:
                raise ValueError(
                    f"{name}: columns {r.start}:{r.stop} split a {column_unit}-wide block"
                )
            return tensor[:, r.start // column_unit : r.stop // column_unit]

        if ".q_proj." in name:
            return tensor[shard.q_heads.start * dim : shard.q_heads.stop * dim]
        if ".k_proj." in name or ".v_proj." in name:
            return tensor[shard.kv_heads.start * dim : shard.kv_heads.stop * dim]
        if name.endswith(".o_proj.weight"):
            return columns(range(shard.q_heads.start * dim, shard.q_heads.stop * dim))
        if ".gate_proj." in name or ".up_proj." in name:
            return tensor[shard.intermediate.start : shard.intermediate.stop]
        if name.endswith(".down_proj.weight"):
            return columns(shard.intermediate)
        if name.endswith("embed_tokens.weight") or name == "lm_head.weight":
            return tensor[shard.vocab.start : shard.vocab.stop]
        return tensor


@dataclass(frozen=True, slots=True)
class _Stack:
    """A decode stack, and the most rows its projections' low-bit path takes."""

    stack: decode_stack.DecodeStack
    max_rows: int


def _rows_for(weight: LoadedWeight, max_rows: int, blocks_max_rows: int | None) -> int:
    """The most rows `weight` serves: GGUF blocks `blocks_max_rows` where given."""
    if blocks_max_rows is not None and isinstance(weight, GGUFBlocks):
        return blocks_max_rows
    return max_rows


def _stacked(parts: list[LoadedWeight]) -> LoadedWeight | None:
    """The parts of a fused projection as one matrix (their rows in order), or None unless
    they share one form: GGUF blocks of one format, or groups of one width and bits."""
    blocks = [p for p in parts if isinstance(p, GGUFBlocks)]
    if blocks:
        if len(blocks) < len(parts) or len({b.fmt for b in blocks}) != 1:
            return None
        return dataclasses.replace(blocks[0], data=torch.cat([b.data for b in blocks]))
    groups = [p for p in parts if isinstance(p, GroupQuantized)]
    if len({(g.bits, g.group, g.mins is None) for g in groups}) != 1:
        return None
    mins = [g.mins for g in groups if g.mins is not None]
    return dataclasses.replace(
        groups[0],
        q=torch.cat([g.q for g in groups]),
        scales=torch.cat([g.scales for g in groups]),
        mins=torch.cat(mins) if mins else None,
    )


def _check_same_values(dense: torch.Tensor, weight: LowBitWeight) -> None:
    """ValueError unless three rows of `weight` rebuild those of `dense` (in its dtype)."""
    rows = dense.shape[0]
    ids = torch.tensor(sorted({0, rows // 2 + 1, rows - 1} & set(range(rows))), dtype=torch.int64)
    if weight.shape != tuple(dense.shape) or not torch.equal(
        weight.rows(ids).to(dense.dtype), dense.detach()[ids].cpu()
    ):
        raise ValueError(
            f"the GGUF blocks {list(weight.shape)} do not hold the loaded "
            f"{list(dense.shape)} weight"
        )


def _adopt_values(dense: torch.Tensor, weight: LowBitWeight) -> None:
    """Overwrite `dense` with the values `weight` holds (what its kernels multiply by)."""
    rows = torch.arange(dense.shape[0], dtype=torch.int64)
    dense.copy_(weight.rows(rows).to(dense.dtype))
