"""Research code that the checkout tests and the wheel does not ship.

``decode_offload/`` models and fuzzes sglang's *decode-side* KV offload manager (a feature toolkv
refuses to share a server with: ``toolkv.sglang.startup.decode_offload_reasons``), so none of it
runs in a toolkv server. It lives beside the package, not in it: ``pip install toolkv`` installs what
the plugin and its commands run, and this folder is imported only by the tests (``tests/``,
``fuzz/``) and by ``python -m research.decode_offload.<module>`` from a checkout. Nothing under
``toolkv/`` may import it (``tests/test_layers.py``).
"""
