"""The agent workload and what is measured on it, shared by the benchmark (``toolkv bench agent``),
the soak, the value report and the twin.

- :mod:`toolkv.workload.plan`     the sessions of a run, drawn up front from one seed (tool-call
  durations, turns, prompts, arrivals, the tool shapes)
- :mod:`toolkv.workload.metrics`  a run's figures from its recorded turns: window throughput, closed
  throughput, resumed TTFT, cache reuse, refusals
- :mod:`toolkv.workload.report`   the Markdown tables the docs embed (``python -m toolkv.workload.report``)

May import: nothing of toolkv. Standard library only: it also runs on a GPU machine next to a
server with nothing installed. Imported by ``toolkv.twin`` and ``toolkv.tools``.
"""
