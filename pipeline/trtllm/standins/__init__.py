"""Stand-ins for the models of a tensorrt_llm repository that only NVIDIA's container has.

`llm` replaces the C++ tensorrt_llm backend with the torch runtime; `preprocessing`,
`postprocessing` and `nvidia_bls` request and return exactly the tensors tensorrtllm_backend
v0.18's python models do (read from their sources, written here). `pipeline.trtllm.harness`
installs them into a generated repository so the real tritonserver here loads it whole.
"""
