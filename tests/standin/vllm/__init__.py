"""Stand-in of the vLLM modules k3verify meets (a test fixture, not vLLM).

Put `tests/standin` on sys.path and `import vllm` gives this package: the module layout and
the call signatures of vLLM's Kimi-K3 mono decode (vllm-project/vllm `mono_decode.py`@9c6c96d8,
`mono/attention/kda.py` and `mono/layer.py`@156b0271, `mono/runner.py`@e2e886c3,
`mono/common/{abi,peer_memory}.py`), at the `tiny` preset's dimensions, whose "kernels" are
k3verify's reference: the host launchers pack the real 30 / 28 kernel arguments by ABI name
(strides read off the tensors, as vLLM's do), and the kernel stand-ins unpack them, rebuild
the strided views and call `ref.kda_pre` / `ref.k2_launch`.
"""

STANDIN = True
