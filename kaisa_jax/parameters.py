"""Each layer's leaves in a params-shaped tree (params, gradients, updates): read and written.

A layer's weight and bias lie in the tree at its ``param_path``; a layer of a
stack made by ``nn.scan`` is one entry (``param_index``) of a stacked leaf.
NNX leaves are found as variables and as plain arrays alike
(`kaisa_jax.capture.plain_path`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from kaisa_jax import layers as layers_lib
from kaisa_jax.capture import plain_path
from kaisa_jax.plan import Plan

Array = jax.Array
# Where to write what: per leaf (its plain path), ``(index, value)`` parts.
Replacements = dict[Any, list[tuple[tuple[int, ...], Array]]]


def leaf_path(spec: layers_lib.LayerSpec, key: str) -> tuple:
  """The plain path of the layer's ``key`` leaf (its weight or bias)."""
  return plain_path((*spec.param_path, jax.tree_util.DictKey(key), *spec.param_suffix))


def layer_params(tree: Any, plan: Plan, what: str) -> dict[str, dict[str, Array]]:
  """Each layer's ``kernel``/``bias`` leaves in ``tree``; a clear error if absent.

  ``what`` names the tree in the errors (``"params"``, ``"updates"``).
  """
  leaves = {plain_path(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}
  out = {}
  for spec, _ in plan.layers:
    entry = {}
    kind = spec.layer_kind
    for key in (kind.weight, kind.bias) if spec.has_bias else (kind.weight,):
      path = (*spec.param_path, jax.tree_util.DictKey(key), *spec.param_suffix)
      leaf = leaves.get(plain_path(path))
      if leaf is not None and spec.param_index:
        leaf = leaf[spec.param_index]
      if leaf is None:
        raise ValueError(
          f"the {what} have no {key} for layer {spec.name!r} at "
          f"{jax.tree_util.keystr(path)}: were kfac's layers traced from this model "
          "and the same params structure?"
        )
      expected = spec.kernel_shape if key == kind.weight else spec.kernel_shape[spec.in_ndim :]
      if tuple(leaf.shape) != expected:
        raise ValueError(
          f"the {what} for layer {spec.name!r} {key} have shape {tuple(leaf.shape)}, "
          f"but kfac's layers say {expected}"
        )
      entry[key] = leaf
    out[spec.name] = entry
  return out


def _replace(leaf: Array, parts: Sequence[tuple[tuple[int, ...], Array]]) -> Array:
  """``leaf`` with each ``(index, value)`` of ``parts`` written at ``leaf[index]``.

  A layer with parameters of its own has one part, at index ``()``; parameters
  stacked by ``nn.scan`` have one part per layer of the stack.
  """
  for index, value in parts:
    leaf = value if index == () else leaf.at[index].set(value)
  return leaf


def with_replacements(tree: Any, replacements: Replacements) -> Any:
  """``tree`` with the parts of ``replacements`` written into its leaves; the others as they are."""
  return jax.tree_util.tree_map_with_path(
    lambda path, leaf: _replace(leaf, replacements.get(plain_path(path), ())), tree
  )
