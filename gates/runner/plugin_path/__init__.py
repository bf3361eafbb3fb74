"""The folder the gate runner puts on PYTHONPATH so pytest can load `-p infer_gate_plugin`.

It holds nothing else, so adding it to the path shadows no module of the code under test.
"""
