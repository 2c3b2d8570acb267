"""TLC and TLA+ plumbing shared by every spec's checks.

- ``tlc``          locate the toolchain, run SANY and TLC, read verdicts and dumped state graphs
- ``tool_output``  TLC's ``-tool`` output: numbered messages in, a verdict out
- ``values``       TLA+ values as TLC prints them, read into Python
- ``pathcover``    walks from the initial states that together take every edge of a state graph
"""
