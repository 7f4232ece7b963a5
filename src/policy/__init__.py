DTYPE_NAMES = ("float32", "bfloat16", "float16", "float64")  # hardware.dtype: the weights' dtype (src/policy/model.py); float64 for CPU-independent golden numbers
