"""What the tests and the H200 benchmarks run SGLang with, and what a server never needs.

``real_lora``: SGLang's own LoRA MoE hooks and Triton runner on a tiny problem (it registers CPU
kernels with ``torch.library`` and patches SGLang's LoRA module, so it stays out of the wheel).
"""
