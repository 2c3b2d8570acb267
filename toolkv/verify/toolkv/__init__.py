"""Assurance for toolkv's own spec (``spec/ToolKV.tla``) over the real caches and the real manager.

- ``spec``          the spec's next-state relation in Python, action by action (the oracle)
- ``refinement``    the refinement mapping (the implementation's abstract state in the spec's
  variables) and the spec's invariants evaluated on it
- ``world``         one real cache stack driven by spec actions (``Replayer``), an executor per action
- ``conformance``   TLC's state graph replayed on the real caches
- ``fuzzing``       the Hypothesis state machine over the real caches (``ToolKVMachine``)
- ``fuzzing_ring``  the same with sglang's load-slot ring in the model
- ``tracecheck``    a fuzz trace validated against the spec's next-state relation with TLC
- ``decisions``     a live server's decision log checked against the spec's session table
- ``mutants``       seeded defects applied from outside the production code
"""
