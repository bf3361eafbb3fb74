"""Kernel tests run the Triton kernels on the CPU through Triton's interpreter.

``triton.jit`` picks the interpreter when a kernel module is imported, so the switch is set
here, before the test modules import anything. Should a test elsewhere in the session have
imported the kernel modules first, they are re-imported so their jit functions are interpreted.
GPU runs at serving sizes live in gates/kernels/.
"""

import importlib
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

for _name in ("kernels.triton.prep_kernel", "kernels.triton.attention_prep", "kernels.triton"):
    if _name in sys.modules:
        importlib.reload(sys.modules[_name])
