"""One module per defect of the catalogue (:mod:`sglang_lora_tma_guard.catalogue`), each with one ``DEFECT``."""
