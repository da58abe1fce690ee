"""A spy on SGLang's kernel launcher, shared by the tests and the random-sweep worker."""


class KernelSpy:
    """Records the TMA arguments of every ``invoke_fused_moe_kernel`` call, then makes it."""

    def __init__(self, real):
        self.real, self.calls = real, []

    def __call__(self, *args, **kwargs):
        self.calls.append({k: kwargs.get(k, False) for k in ("a_use_tma", "b_use_tma", "c_sorted")})
        return self.real(*args, **kwargs)
