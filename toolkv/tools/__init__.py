"""The ``toolkv`` command line and what only it runs: demo, simulation, benchmarks, diagrams, fuzz
campaigns. The top layer: may import everything below it; nothing imports it."""
