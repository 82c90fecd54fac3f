"""The parallel layout, owned by one object and validated before any process group exists.

Megatron-Core lays ranks out twice over the same world: the dense part (attention, embeddings)
as tp * cp * dp * pp, and the expert part as etp * ep * edp * pp. Both must tile the world, and
the pipeline stages must be the same ranks in both (megatron-core asserts this with its default
order "tp-cp-ep-dp-pp").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from megatron_rl.config import ConfigError


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """How the model is split; dp is derived from the world size (megatron_rl.parallel.dims)."""

    tp: int = 1
    """Tensor parallel size."""
    pp: int = 1
    """Pipeline parallel size."""
    ep: int = 1
    """Expert parallel size."""
    cp: int = 1
    """Context parallel size."""
    etp: int | None = None
    """Expert tensor parallel size (each expert's weights split over etp ranks); None takes tp.
    With tp > 1, etp=1 keeps each expert whole and spreads the experts by ep instead."""

    def validate(self) -> None:
        for name in ("tp", "pp", "ep", "cp", "etp"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"parallel.{name}: expected a positive int, got {value}")


@dataclass(frozen=True, kw_only=True)
class ParallelDims(ParallelConfig):
    """The layout of `ParallelConfig` over `world_size` ranks, with what it implies.

    Attributes (besides the split sizes of `ParallelConfig`; tp: attention, dense layers and
    vocabulary; pp: stages of consecutive layers; cp: the sequence; ep: the experts; etp: each
    expert's weights, None meaning tp):
        world_size: number of ranks (processes), one per device.
        dp: data parallel size of the dense part; None derives it from the others.
        sequence_parallel: shard activations between TP regions along the sequence; None
            means "on whenever tp > 1", which megatron-core requires for MoE with TP.
    """

    world_size: int
    dp: int | None = None
    sequence_parallel: bool | None = None

    @classmethod
    def of(cls, config: ParallelConfig, world_size: int) -> ParallelDims:
        """The recipe's layout `config` over `world_size` ranks."""
        return cls(world_size=world_size, **dataclasses.asdict(config))

    def __post_init__(self) -> None:
        for name in ("world_size", "tp", "pp", "cp", "ep", "etp", "dp"):
            value = getattr(self, name)
            if value is None and name in ("etp", "dp"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        model_size = self.tp * self.pp * self.cp
        if self.world_size % model_size != 0:
            raise ValueError(
                f"parallel layout: tp({self.tp})*pp({self.pp})*cp({self.cp})*dp(?) != "
                f"world_size({self.world_size}): {self.world_size} is not a multiple of "
                f"{model_size}"
            )
        derived_dp = self.world_size // model_size
        if self.dp is not None and self.dp != derived_dp:
            raise ValueError(
                f"parallel layout: tp({self.tp})*pp({self.pp})*cp({self.cp})*dp({self.dp}) = "
                f"{model_size * self.dp} != world_size({self.world_size}); dp must be "
                f"{derived_dp}"
            )
        object.__setattr__(self, "dp", derived_dp)
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)
        expert_size = self.etp * self.ep * self.pp
        if self.world_size % expert_size != 0:
            raise ValueError(
                f"parallel layout: etp({self.etp})*ep({self.ep})*pp({self.pp})*edp(?) != "
                f"world_size({self.world_size}): {self.world_size} is not a multiple of "
                f"{expert_size}"
            )
        if self.sequence_parallel is None:
            object.__setattr__(self, "sequence_parallel", self.tp > 1)
        elif self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel: needs tp > 1 (it shards between TP regions)")

    @property
    def edp(self) -> int:
        """Data parallel size of the expert part: world_size / (etp * ep * pp)."""
        return self.world_size // (self.etp * self.ep * self.pp)

    @property
    def replicates_weights(self) -> bool:
        """True when some weight is held by more than one rank of a data-parallel group (dense
        weights over dp * cp ranks, expert weights over edp): only then has the distributed
        optimizer anything to shard."""
        return self.dp * self.cp > 1 or self.edp > 1

    def check_model(
        self,
        *,
        num_layers: int,
        num_attention_heads: int,
        num_query_groups: int,
        vocab_size: int,
        num_experts: int,
        moe_ffn_hidden_size: int,
        ffn_hidden_size: int,
        more_tp_splits: Mapping[str, int] | None = None,
    ) -> None:
        """Raise a ValueError, with the arithmetic, if the model cannot be split this way.
        `more_tp_splits` names further widths that tensor parallelism splits."""
        rules = [
            ("num_layers", num_layers, "pp", self.pp),
            ("num_attention_heads", num_attention_heads, "tp", self.tp),
            ("num_query_groups", num_query_groups, "tp", self.tp),
            ("vocab_size", vocab_size, "tp", self.tp),
            ("num_experts", num_experts, "ep", self.ep),
            ("moe_ffn_hidden_size", moe_ffn_hidden_size, "etp", self.etp),
            ("ffn_hidden_size", ffn_hidden_size, "tp", self.tp),
            *((field, size, "tp", self.tp) for field, size in (more_tp_splits or {}).items()),
        ]
        for field, size, dim, parts in rules:
            if size % parts != 0:
                raise ValueError(
                    f"{field}: {size} is not divisible by {dim}({parts}) "
                    f"({size} % {parts} = {size % parts})"
                )
        if self.tp > 1 and num_experts > 1 and not self.sequence_parallel:
            raise ValueError(
                "sequence_parallel: megatron-core needs sequence parallelism for MoE layers "
                f"with tensor parallelism (tp={self.tp})"
            )

    def describe(self) -> str:
        """One line for logs, e.g. `world 8 = tp2 * cp1 * pp2 * dp2; experts: etp2 * ep2 * edp1`."""
        return (
            f"world {self.world_size} = tp{self.tp} * cp{self.cp} * pp{self.pp} * dp{self.dp}; "
            f"experts: etp{self.etp} * ep{self.ep} * pp{self.pp} * edp{self.edp}"
            + ("; sequence parallel" if self.sequence_parallel else "")
        )
