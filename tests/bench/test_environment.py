"""Where a measurement was taken: the CPU's vector extensions are part of it."""

from verispec.bench.environment import describe_cpu, vector_isa


def test_the_widest_vector_extension_is_named():
    zen4 = "fpu sse2 avx avx2 fma f16c avx512f avx512bw avx512vl avx512_vnni"
    assert vector_isa(zen4) == "avx512-vnni"
    assert vector_isa(zen4 + " amx_bf16 amx_tile amx_int8") == "avx512-vnni+amx"
    assert vector_isa("avx2 fma avx512f avx512bw") == "avx512"
    assert vector_isa("fpu sse2 avx avx2 fma f16c") == "avx2"
    assert vector_isa("fpu sse2 avx") is None
    assert vector_isa("") is None


def test_reports_print_the_extension_beside_the_model_name():
    assert describe_cpu({"cpu": "AMD EPYC", "isa": "avx2", "cores": 2}) == "AMD EPYC (avx2), 2 cores"
    assert describe_cpu({"cpu": "AMD EPYC", "cores": 2}) == "AMD EPYC (vector ISA unknown), 2 cores"
