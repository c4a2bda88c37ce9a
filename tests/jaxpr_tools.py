"""Walking jaxprs: which primitives a traced program runs, and where."""

import jax


def subjaxprs(eqn):
  """The jaxprs nested in one equation (cond branches, jit and shard_map bodies, ...)."""
  for value in eqn.params.values():
    for item in value if isinstance(value, tuple | list) else (value,):
      if isinstance(item, jax.extend.core.ClosedJaxpr):
        yield item.jaxpr
      elif isinstance(item, jax.extend.core.Jaxpr):
        yield item


def primitives(jaxpr, into_cond: bool = True) -> set[str]:
  """Primitive names reachable from ``jaxpr``, optionally not descending into conds."""
  names = set()
  for eqn in jaxpr.eqns:
    names.add(eqn.primitive.name)
    if eqn.primitive.name != "cond" or into_cond:
      for sub in subjaxprs(eqn):
        names |= primitives(sub, into_cond)
  return names


def count(jaxpr, name: str) -> int:
  """How many times primitive ``name`` appears in ``jaxpr`` and everything nested in it."""
  return sum(
    (eqn.primitive.name == name) + sum(count(sub, name) for sub in subjaxprs(eqn))
    for eqn in jaxpr.eqns
  )


def switches(jaxpr):
  """The branch lists of every multi-way switch (a cond with more than two branches)."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "cond" and len(eqn.params["branches"]) > 2:
      yield [b.jaxpr for b in eqn.params["branches"]]
    for sub in subjaxprs(eqn):
      yield from switches(sub)
