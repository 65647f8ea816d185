"""Our python models of the tensorrt_llm backend's repository, copied by engine_repo as <model>/1/model.py.

They run inside tritonserver's python backend (`triton_python_backend_utils` exists only there), in
NVIDIA's container on a GPU and in the tests' tritonserver here; nothing in the pipeline imports them.
"""
