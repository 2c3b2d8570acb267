"""Assurance for the L3 storage tier (``spec/storage/StorageTier.tla``) over sglang's real
``HiCacheFile``.

- ``spec``         the model in Python: bounds, actions, invariants (the fuzz campaign's oracle)
- ``world``        the tier on real parts, one method per spec action, and the refinement mapping
- ``conformance``  TLC's state graph replayed on the real stack
- ``fuzzing``      the Hypothesis state machine and its mutant campaign
"""
