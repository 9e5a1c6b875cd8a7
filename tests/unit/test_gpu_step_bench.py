"""bench/gpu_step.py's profile line: the time of an update's kernels (on a CPU, its aten ops)
split into kinds of work by name, checked on names as the CUDA and CPU profilers report them."""

import runpy
from pathlib import Path

import pytest

GPU_STEP = runpy.run_path(str(Path(__file__).resolve().parents[2] / "bench" / "gpu_step.py"))


def test_cuda_kernel_time_splits_into_kinds_of_work():
    times = {
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": 30.0,
        "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT": 20.0,  # cuBLAS's own Hopper GEMMs (CUDA >= 12.8)
        "void flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits>": 20.0,
        "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)": 5.0,
        "Memcpy DtoH (Device -> Pinned)": 5.0,
        "void at::native::multi_tensor_apply_kernel<at::native::FusedAdamMathFunctor<float, 4>>": 10.0,
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>": 5.0,
        "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float>": 5.0,  # the entropy's
    }
    assert GPU_STEP["work_shares"](times) == pytest.approx(
        {"communication": 0.05, "attention": 0.2, "matmul": 0.5, "optimizer": 0.1, "copies": 0.05, "other": 0.1})


def test_cpu_aten_op_time_splits_into_kinds_of_work():
    times = {"aten::mm": 2.0, "aten::baddbmm": 1.0, "aten::addmm": 1.0, "aten::_scaled_dot_product_flash_attention_for_cpu": 2.0,
             "aten::copy_": 1.0, "aten::mul": 2.0, "aten::mm_backward_helper": 1.0}
    assert GPU_STEP["work_shares"](times) == pytest.approx(
        {"communication": 0.0, "attention": 0.2, "matmul": 0.4, "optimizer": 0.0, "copies": 0.1, "other": 0.3})


def test_host_side_counts_launches_and_the_time_spent_waiting_for_the_gpu():
    calls = {"cudaLaunchKernel": (9000, 45_000.0), "cuLaunchKernelEx": (1000, 5_000.0),  # (count, microseconds)
             "cudaStreamSynchronize": (10, 200_000.0), "cudaDeviceSynchronize": (1, 100_000.0),
             "cudaMemcpyAsync": (20, 250_000.0), "cudaStreamIsCapturing": (500, 1_000.0)}
    line = GPU_STEP["host_side"](calls, 2.0, 5)
    assert line == ("host: 10000 kernel launches (2000 per micro-batch, 200 us of wall time each); waited for the GPU "
                    "0.55 s of 2.00 s (synchronize 0.30 s, copies 0.25 s)")
