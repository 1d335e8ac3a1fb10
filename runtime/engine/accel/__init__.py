"""What only an accelerator needs beside the engine core: the CUDA-graph decode ladder (cuda_graphs) and the
warm-up that compiles every Triton kernel variant a served step can meet before the server opens (warm_up).
The core runs without them (CPU, `use_cuda_graphs` and `warm_up` off); the model runner and the engine call in.
"""
