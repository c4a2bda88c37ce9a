"""Mutation testing of kaisa_jax's numerics: ``python -m mutation`` (docs/development.md).

* `mutation.mutants`: the mutants of a source file, and what is never mutated;
* `mutation.runner`: runs each mutant against the module's tests and restores the file;
* `mutation.report`: the Markdown report and the triage of survivors (``triage.toml``).
"""
