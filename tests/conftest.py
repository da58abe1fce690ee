import os
import sys
from pathlib import Path

# SGLang's Triton kernels run on CPU through Triton's interpreter; the switch must be set before
# Triton compiles them, that is before anything imports SGLang.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.pop("SGLANG_LORA_TMA_GUARD", None)
os.environ.pop("SGLANG_PLUGINS", None)

sys.path.insert(0, str(Path(__file__).parent))
