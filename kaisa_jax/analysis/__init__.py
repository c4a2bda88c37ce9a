"""Analysis of compiled steps: what they cost, what they move, how long they would take.

Benchmark tooling, not needed to train: ``import kaisa_jax`` does not load it.

* `kaisa_jax.analysis.accounting`: the collectives of a compiled program, read
  from its HLO text, with the bytes each moves per device.
* `kaisa_jax.analysis.projection`: a compiled program's flops, bytes and
  kernels from its HLO text, this host's rates, K-FAC's phases compiled apart,
  and the projected time of a train step on a `kaisa_jax.Cluster`.
"""

from kaisa_jax.analysis import accounting, projection

__all__ = ["accounting", "projection"]
