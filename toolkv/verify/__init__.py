"""Assurance: the TLC driver, spec-check over every config and mutant, trace-check, the refinement
mapping from implementation to spec, the conformance replay of TLC's state graph and the Hypothesis
state machine that fuzzes the real caches.

May import: ``toolkv.core``, ``toolkv.errors``, ``toolkv.testing``. Never ``toolkv.sglang`` or
``toolkv.tools``. Not needed by a server: nothing in ``core`` or ``sglang`` imports it.
"""
