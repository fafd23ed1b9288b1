"""Adapters that say where a transformer keeps what the text attack reads.

The attack needs, of the model the client started from: the token embeddings, the first two
blocks' input norms and the projections that read them (their gradients give the spans), the
first block's attention and MLP (to compute the second block's input for a candidate prefix),
and the output layer (for the last token). A family is a small adapter over those modules,
found by attribute, as ``transformers`` names them; parameter names are looked up in the
user's own ``model.named_parameters()``, so a wrapped model (PEFT, a custom head) keeps its
names. Only torch is imported here: the model object is the caller's.

Families
--------
``rotary``   LLaMA and its relatives (SmolLM2, Mistral, Qwen2): RMSNorm, rotary positions
             applied after the projections, grouped-query attention, gated MLP.
``learned``  GPT-2: LayerNorm, learned absolute positions added to the token embeddings,
             fused ``c_attn`` in ``Conv1D`` layout (weight (in, out)).
``encoder``  BERT and its relatives (MiniLM): bidirectional attention, learned absolute
             positions and token types, LayerNorm *after* each residual sum (post-norm), so
             a block's input is the previous block's normalised output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


class UnsupportedModel(ValueError):
    """The model's architecture is not one the text attack has an adapter for."""


@dataclass(frozen=True)
class Reader:
    """A parameter whose gradient's rows span one layer input, and how to orient them.

    Attributes
    ----------
    name : str
        Its name in the caller's ``model.named_parameters()``.
    transpose : bool
        True for ``Conv1D`` weights (in, out): the rows are the gradient's transpose.
    adapter : str | None
        For a projection wrapped by a PEFT LoRA adapter: the name of its ``lora_A`` weight
        (r, in), whose gradient ``(Bᵀ ∂L/∂Y)ᵀ X`` spans the same inputs while fewer than r
        positions carry a gradient. Read when the base weight's gradient is absent (frozen).
    adapter_rank : int
        r, the adapter's rank (0 without an adapter).
    """

    name: str
    transpose: bool
    adapter: str | None = None
    adapter_rank: int = 0


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Family:
    """What every adapter provides; see the module docstring for the two families.

    Parameters
    ----------
    model
        The module the client started from (a ``transformers`` causal LM).
    """

    name = "family"
    #: Whether block 0's input depends on the position (learned absolute positions).
    positional_inputs = False
    #: Whether attention sees the whole sentence (encoders): sentences are then searched as
    #: wholes (:mod:`fl_attack.text.encoder`), not grown as causal prefixes.
    bidirectional = False

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        #: The transformer itself (a PEFT model's base model): where the modules are found.
        self.root = model.get_base_model() if hasattr(model, "get_base_model") else model
        self._names = {id(p): n for n, p in model.named_parameters()}
        self.embed: nn.Embedding = self._embedding()
        self.blocks = self._blocks()
        if len(self.blocks) < 2:
            raise UnsupportedModel(f"{type(model).__name__} has {len(self.blocks)} block(s); the "
                                   "text attack reads the first two")
        self.vocab_size = int(self.embed.weight.shape[0])

    # -- where the parameters are -----------------------------------------------------
    def name_of(self, param: nn.Parameter) -> str:
        """The parameter's name in the caller's model."""
        return self._names[id(param)]

    def reader(self, module: nn.Module, transpose: bool = False) -> Reader:
        """The reader of a projection, with its LoRA adapter where PEFT wrapped it."""
        lora = getattr(module, "lora_A", None)
        if isinstance(lora, nn.ModuleDict) and len(lora) == 1:
            a = next(iter(lora.values())).weight
            return Reader(self.name_of(module.weight), transpose, self.name_of(a),
                          int(a.shape[0]))
        return Reader(self.name_of(module.weight), transpose)

    def readers(self, block: int, part: str) -> list[Reader]:
        """Parameters whose gradients span ``part`` (``"attn"`` or ``"mlp"``) of ``block``."""
        raise NotImplementedError

    def output_weight(self) -> str | None:
        """The name of the output layer's weight (the tied embedding where tied); None for a
        model without a language-model head (an encoder with a classification head)."""
        head = self.root.get_output_embeddings()
        if head is None:
            if self.bidirectional:
                return None
            raise UnsupportedModel(f"{type(self.model).__name__} has no output layer")
        return self.name_of(head.weight)

    def max_positions(self) -> int:
        """The longest sequence the model's position table holds (learned positions)."""
        raise NotImplementedError

    def classifier(self) -> nn.Linear | None:
        """A sequence classifier's head (its weight's update gives the labels); None else."""
        head = getattr(self.root, "classifier", None)
        return head if isinstance(head, nn.Linear) else None

    # -- the forward pieces -----------------------------------------------------------
    def embeddings(self, tokens: torch.Tensor, position: int) -> torch.Tensor:
        """The residual stream entering block 0 for ``tokens`` at ``position``."""
        return self.embed.weight[tokens]

    def attn_input(self, block: int, h: torch.Tensor) -> torch.Tensor:
        """The input of ``block``'s attention projections for residual stream ``h``."""
        raise NotImplementedError

    def qkv(self, x: torch.Tensor, position: int) -> tuple[torch.Tensor, ...]:
        """Block 0's query, key, value of inputs ``x`` (N, d) at ``position``, each
        (N, heads, head_dim), positions applied."""
        raise NotImplementedError

    def after_attention(self, h: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """Block 0's residual stream after attention: ``h + o_proj(attended)``."""
        raise NotImplementedError

    def mlp_input(self, h: torch.Tensor) -> torch.Tensor:
        """The input of block 0's MLP for residual stream ``h`` (after attention)."""
        raise NotImplementedError

    def after_mlp(self, h: torch.Tensor) -> torch.Tensor:
        """Block 0's output for residual stream ``h`` (after attention)."""
        return h + self.blocks[0].mlp(self.mlp_input(h))

    @property
    def scaling(self) -> float:
        """The attention's score scale."""
        raise NotImplementedError

    @property
    def groups(self) -> int:
        """Query heads per key/value head (grouped-query attention)."""
        return 1

    # -- private ----------------------------------------------------------------------
    def _embedding(self) -> nn.Embedding:
        return self.root.get_input_embeddings()

    def _blocks(self) -> nn.ModuleList:
        raise NotImplementedError


class Rotary(Family):
    """LLaMA-style decoders: ``model.model.layers[i]`` with ``input_layernorm``,
    ``self_attn.{q,k,v,o}_proj``, ``post_attention_layernorm`` and a gated ``mlp``."""

    name = "rotary"

    def _blocks(self) -> nn.ModuleList:
        return self.root.model.layers

    def readers(self, block: int, part: str) -> list[Reader]:
        b = self.blocks[block]
        mods = ([b.self_attn.q_proj, b.self_attn.k_proj, b.self_attn.v_proj] if part == "attn"
                else [b.mlp.gate_proj, b.mlp.up_proj])
        return [self.reader(m) for m in mods]

    def attn_input(self, block: int, h: torch.Tensor) -> torch.Tensor:
        return self.blocks[block].input_layernorm(h)

    def qkv(self, x: torch.Tensor, position: int) -> tuple[torch.Tensor, ...]:
        attn = self.blocks[0].self_attn
        hd = attn.head_dim
        q = attn.q_proj(x).unflatten(-1, (-1, hd))
        k = attn.k_proj(x).unflatten(-1, (-1, hd))
        v = attn.v_proj(x).unflatten(-1, (-1, hd))
        pos = torch.tensor([[position]], device=x.device)
        cos, sin = self.root.model.rotary_emb(x[:1], pos)
        cos, sin = cos[0, 0].to(x.dtype), sin[0, 0].to(x.dtype)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        return q, k, v

    def after_attention(self, h: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        return h + self.blocks[0].self_attn.o_proj(attended)

    def mlp_input(self, h: torch.Tensor) -> torch.Tensor:
        return self.blocks[0].post_attention_layernorm(h)

    @property
    def scaling(self) -> float:
        attn = self.blocks[0].self_attn
        return float(getattr(attn, "scaling", attn.head_dim ** -0.5))

    @property
    def groups(self) -> int:
        cfg = self.root.config
        return int(cfg.num_attention_heads // getattr(cfg, "num_key_value_heads",
                                                      cfg.num_attention_heads))


class Learned(Family):
    """GPT-2-style decoders: ``transformer.h[i]`` with ``ln_1``, ``attn.c_attn`` (Conv1D),
    ``attn.c_proj``, ``ln_2`` and ``mlp.c_fc``; positions ``transformer.wpe``."""

    name = "learned"
    positional_inputs = True

    def _blocks(self) -> nn.ModuleList:
        return self.root.transformer.h

    def readers(self, block: int, part: str) -> list[Reader]:
        b = self.blocks[block]
        return [self.reader(b.attn.c_attn if part == "attn" else b.mlp.c_fc, transpose=True)]

    def max_positions(self) -> int:
        return int(self.root.transformer.wpe.weight.shape[0])

    def embeddings(self, tokens: torch.Tensor, position: int) -> torch.Tensor:
        return self.embed.weight[tokens] + self.root.transformer.wpe.weight[position]

    def attn_input(self, block: int, h: torch.Tensor) -> torch.Tensor:
        return self.blocks[block].ln_1(h)

    def qkv(self, x: torch.Tensor, position: int) -> tuple[torch.Tensor, ...]:
        attn = self.blocks[0].attn
        q, k, v = attn.c_attn(x).split(attn.split_size, dim=-1)
        return tuple(t.unflatten(-1, (-1, attn.head_dim)) for t in (q, k, v))

    def after_attention(self, h: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        return h + self.blocks[0].attn.c_proj(attended)

    def mlp_input(self, h: torch.Tensor) -> torch.Tensor:
        return self.blocks[0].ln_2(h)

    @property
    def scaling(self) -> float:
        attn = self.blocks[0].attn
        return 1.0 / math.sqrt(attn.head_dim) if attn.scale_attn_weights else 1.0


class Encoder(Family):
    """BERT-style encoders: ``encoder.layer[i]`` with ``attention.self.{query,key,value}``,
    ``attention.output.{dense,LayerNorm}``, ``intermediate.dense`` and
    ``output.{dense,LayerNorm}``; embeddings ``word + position + token type`` through
    ``embeddings.LayerNorm``. Sentences are read with token type 0 (one segment)."""

    name = "encoder"
    positional_inputs = True
    bidirectional = True

    @property
    def _base(self) -> nn.Module:
        return getattr(self.root, "base_model", self.root)

    def _blocks(self) -> nn.ModuleList:
        return self._base.encoder.layer

    def max_positions(self) -> int:
        return int(self._base.embeddings.position_embeddings.weight.shape[0])

    def readers(self, block: int, part: str) -> list[Reader]:
        b = self.blocks[block]
        a = b.attention.self
        return [self.reader(m) for m in ([a.query, a.key, a.value] if part == "attn"
                                         else [b.intermediate.dense])]

    def embeddings(self, tokens: torch.Tensor, position: int) -> torch.Tensor:
        emb = self._base.embeddings
        x = (self.embed.weight[tokens] + emb.position_embeddings.weight[position]
             + emb.token_type_embeddings.weight[0])
        return emb.LayerNorm(x)

    def attn_input(self, block: int, h: torch.Tensor) -> torch.Tensor:
        return h

    def qkv(self, x: torch.Tensor, position: int) -> tuple[torch.Tensor, ...]:
        a = self.blocks[0].attention.self
        hd = a.attention_head_size
        return tuple(m(x).unflatten(-1, (-1, hd)) for m in (a.query, a.key, a.value))

    def after_attention(self, h: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        out = self.blocks[0].attention.output
        return out.LayerNorm(h + out.dense(attended))

    def mlp_input(self, h: torch.Tensor) -> torch.Tensor:
        return h

    def after_mlp(self, h: torch.Tensor) -> torch.Tensor:
        b = self.blocks[0]
        return b.output.LayerNorm(h + b.output.dense(b.intermediate(h)))

    @property
    def scaling(self) -> float:
        return 1.0 / math.sqrt(self.blocks[0].attention.self.attention_head_size)


_FAMILIES = {"llama": Rotary, "mistral": Rotary, "qwen2": Rotary, "gpt2": Learned,
             "bert": Encoder}


def family_of(model: nn.Module) -> Family:
    """The adapter for ``model``, chosen by its ``config.model_type``.

    Raises
    ------
    UnsupportedModel
        Naming the model type and the families covered.
    """
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in _FAMILIES:
        raise UnsupportedModel(
            f"the text attack has no adapter for model type {kind!r} "
            f"({type(model).__name__}); covered: {', '.join(sorted(_FAMILIES))}")
    return _FAMILIES[kind](model)
