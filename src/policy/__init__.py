DTYPE_NAMES = ("float32", "bfloat16", "float16")  # hardware.dtype: the weights' dtype (src/policy/model.py)
