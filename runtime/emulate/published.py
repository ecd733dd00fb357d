"""Published GPU spec-sheet rates and single-GPU training throughputs, with citations, for the emulated devices."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ALIASES", "SIBLINGS", "SPECS", "THROUGHPUTS", "Spec", "Throughput"]

# How to read this module
# -----------------------
# * Every number below was read from the source named next to it; nothing is scaled or estimated.
#   Where a fact could not be read from a primary source it says so ("unverified", "secondary").
# * Peak rates are at the boost clock, as NVIDIA's spec sheets quote them. Tensor-core rates are DENSE
#   (NVIDIA's H100 datasheet quotes 2:4-sparse rates, twice these).
# * Throughputs are whole training steps (forward + backward + update) unless the note says otherwise;
#   the 2015-2017 Torch7 figures (jcjohnson/cnn-benchmarks, soumith/convnet-benchmarks) are forward +
#   backward only, no loss and no optimizer step.
# * "ms per batch" sources are converted as samples_per_s = batch * 1000 / ms (the note keeps the ms).
# * Model names follow runtime.workloads where they match: "resnet50-224" is ResNet-50 v1 or v1.5 at
#   224x224 (the note says which), "vgg19-224", "vgg16-224"; "transformer-big" is the fairseq
#   transformer_wmt_en_de_big_t2t (d_model 1024, 6+6 layers); other names are free-form.
# * Software generations differ by up to ~20 % for one model on one card (framework, cuDNN version,
#   data layout, v1 vs v1.5): read "framework" and "note" before fitting a device to several points.

_DLE = "NVIDIA/DeepLearningExamples@729963dd47e7c8bd462ad10bfac7a7b0b604e6dd"
_JCJ = ("jcjohnson/cnn-benchmarks@83d441f852134f4a98aa3e665499d9369b6141c9 README.md "
        "(https://github.com/jcjohnson/cnn-benchmarks)")
_SOUMITH = ("soumith/convnet-benchmarks@b458aab61c0ac2257c0990119b5de15c1e886f02 README.md, "
            "'Imagenet Winners Benchmarking' (numbers of 2016-02-28 and 2016-04-25)")
_LAMBDA_PT = "lambdal/deeplearning-benchmark@aa5addb6a53675a649a80036dad548f1c27cbcc4"
_LAMBDA_TF = "LambdaColdStorage/lambda-tensorflow-benchmark@e086e0e7d88a19991642d0774793693d4b7cbe46"
_MXNET_PERF = "apache/mxnet@054aeee586d9e6e058eb0f77f1f422c2186f6daf docs/faq/perf.md, 'Training results', V100"


@dataclass(frozen=True)
class Spec:
    """A GPU's spec-sheet rates (TFLOP/s, GB/s with GB = 1e9 B) and memory size."""

    name: str
    full_name: str
    peak_fp32_tflops: float
    peak_fp16_tflops: float | None   # dense tensor-core FP16; None where FP16 is not faster than FP32
    peak_tf32_tflops: float | None   # dense TF32 tensor-core rate; None before Ampere
    mem_bandwidth_gbs: float
    memory_gib: float
    year: int
    source: str
    note: str = ""


@dataclass(frozen=True)
class Throughput:
    """One published single-GPU training throughput: samples_per_s is in `unit` (images/s, tokens/s...)."""

    device: str          # key into SPECS
    model: str
    batch: int           # per GPU, in the unit the source counts (images, sentences, or tokens: see note)
    precision: str       # "fp32", "tf32" or "amp"
    samples_per_s: float
    unit: str
    framework: str
    source: str
    note: str = ""


SPECS: dict[str, Spec] = {
    "h100": Spec(
        name="h100", full_name="NVIDIA H100 SXM5 80GB HBM3 (GH100, 132 SMs)",
        peak_fp32_tflops=67.0, peak_fp16_tflops=989.4, peak_tf32_tflops=494.7,
        mem_bandwidth_gbs=3350.0, memory_gib=80.0, year=2022,
        source=("NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column: FP32 67 TFLOPS, TF32 Tensor Core "
                "989 TFLOPS and FP16 Tensor Core 1,979 TFLOPS *with sparsity*, 80 GB, 3.35 TB/s; the dense rates "
                "(494.7 TF32, 989.4 FP16, i.e. half the sparse ones; FP32 66.9 at 1.98 GHz) as tabulated at "
                "https://glennklockwood.com/garden/processors/h100"),
        note=("SXM5 figures: our box reports 'NVIDIA H100 80GB HBM3', which is the SXM5 part (the PCIe card is "
              "HBM2e, 2.0 TB/s, FP32 51, dense TF32 378 / FP16 756 TFLOPS, 350 W). SXM5 is a 700 W part.")),
    "v100": Spec(
        name="v100", full_name="NVIDIA Tesla V100 SXM2 (GV100, 80 SMs, 300 W), 16 or 32 GB HBM2",
        peak_fp32_tflops=15.7, peak_fp16_tflops=125.0, peak_tf32_tflops=None,
        mem_bandwidth_gbs=900.0, memory_gib=32.0, year=2017,
        source=("NVIDIA V100 Tensor Core GPU datasheet, V100 SXM2 column: single precision 15.7 TFLOPS, "
                "tensor performance 125 TFLOPS, 32/16 GB HBM2, 900 GB/s (V100 PCIe: 14 / 112 TFLOPS)"),
        note=("The 16 GB and 32 GB SXM2 parts have the same rates (DeepLearningExamples ResNet-50: 367 vs 356 "
              "img/s FP32); memory_gib is the 32 GB part. MSTopK's Tencent cluster: 'Nvidia Tesla V100' per its "
              "abstract; the exact variant was not verified (see PAPERS['mstopk']).")),
    "titanx-maxwell": Spec(
        name="titanx-maxwell", full_name="NVIDIA GeForce GTX TITAN X (Maxwell GM200, 3072 CUDA cores, 2015)",
        peak_fp32_tflops=6.6, peak_fp16_tflops=None, peak_tf32_tflops=None,
        mem_bandwidth_gbs=336.5, memory_gib=12.0, year=2015,
        source=("NVIDIA GeForce GTX TITAN X specifications (geforce.com): 3072 CUDA cores, base 1000 / boost "
                "1075 MHz, 12 GB GDDR5, 7.0 Gbps, 384-bit, 336.5 GB/s; 3072 x 2 x 1.075 GHz = 6.6 TFLOPS. "
                "jcjohnson/cnn-benchmarks lists 6.14 TFLOPS (the base clock)."),
        note="Maxwell has no fast FP16 path (peak_fp16_tflops None). Compute capability 5.2."),
    "p4000": Spec(
        name="p4000", full_name="NVIDIA Quadro P4000 (Pascal GP104, 1792 CUDA cores, 105 W)",
        peak_fp32_tflops=5.3, peak_fp16_tflops=None, peak_tf32_tflops=None,
        mem_bandwidth_gbs=243.0, memory_gib=8.0, year=2017,
        source=("NVIDIA Quadro P4000 datasheet: 1792 CUDA cores, FP32 5.3 TFLOPS, 8 GB GDDR5, up to 243 GB/s, "
                "105 W (boost 1480 MHz: 1792 x 2 x 1.48 GHz = 5.30 TFLOPS)"),
        note=("P3's GPU (secondary source, see PAPERS['p3']). No published single-GPU training throughput for "
              "the P4000 was found: SIBLINGS['p4000'] points to the GTX 1080 (same GP104 die, 2560 cores, 8.9 "
              "TFLOPS, 320 GB/s). GP104 runs FP16 arithmetic at 1/64 of FP32, hence peak_fp16_tflops None.")),
    "1080ti": Spec(
        name="1080ti", full_name="NVIDIA GeForce GTX 1080 Ti (Pascal GP102, 3584 CUDA cores, 2017)",
        peak_fp32_tflops=11.3, peak_fp16_tflops=None, peak_tf32_tflops=None,
        mem_bandwidth_gbs=484.0, memory_gib=11.0, year=2017,
        source=("NVIDIA GeForce GTX 1080 Ti specifications: 3584 CUDA cores, boost 1582 MHz (11.3 TFLOPS), "
                "11 GB GDDR5X, 11 Gbps, 352-bit, 484 GB/s. jcjohnson/cnn-benchmarks lists 10.6 TFLOPS "
                "(base clock 1480 MHz)."),
        note=("Stand-in for SpecTrain's GPU, which we could not verify (see PAPERS['spectrain']). The Pascal "
              "TITAN X (GP102, 3584 cores) and TITAN Xp (3840 cores, 12.1 TFLOPS, 548 GB/s) are the same die: "
              "jcjohnson measures the Pascal TITAN X within 2 % of the 1080 Ti on every model. GP102 runs FP16 "
              "arithmetic at 1/64 of FP32, hence peak_fp16_tflops None.")),
    "gtx1080": Spec(
        name="gtx1080", full_name="NVIDIA GeForce GTX 1080 (Pascal GP104, 2560 CUDA cores, 2016)",
        peak_fp32_tflops=8.9, peak_fp16_tflops=None, peak_tf32_tflops=None,
        mem_bandwidth_gbs=320.0, memory_gib=8.0, year=2016,
        source=("NVIDIA GeForce GTX 1080 specifications: 2560 CUDA cores, boost 1733 MHz (8.9 TFLOPS), 8 GB "
                "GDDR5X, 10 Gbps, 256-bit, 320 GB/s; jcjohnson/cnn-benchmarks lists 8.87 TFLOPS"),
        note="Sibling of the Quadro P4000 (same GP104 die, more cores, faster memory): see SIBLINGS."),
}
SPECS["titanx"] = SPECS["titanx-maxwell"]

# Alternative keys: the same Spec object under a second name.
ALIASES: dict[str, str] = {"titanx": "titanx-maxwell"}

# Devices without any published training throughput of their own, and the well-documented card of the
# same die whose figures stand nearest. Calibrate the sibling's spec against its points; do NOT read the
# sibling's images/s as the device's.
SIBLINGS: dict[str, str] = {"p4000": "gtx1080"}


def _per_s(batch: int, ms: float) -> float:
    return round(batch * 1000.0 / ms, 2)


_JCJ_NOTE = ("forward + backward (weight gradients included), no loss, no optimizer step; Torch7, random "
             "16x3x224x224 input, mean of 10 passes after one warm-up; {ms} ms per batch of 16 converted; {lib}")

THROUGHPUTS: tuple[Throughput, ...] = (
    # ---------------------------------------------------------------- H100 SXM5 80GB
    Throughput("h100", "resnet50-224", 640, "tf32", 1893.2, "images/s", "PyTorch, NGC pytorch:24.10-py3",
               f"{_LAMBDA_PT} pytorch/results_v2/LambdaOD_1x_1xH100_80GB_SXM5_192-222-52-83_v2/"
               "PyTorch_resnet50_FP32/30-10-2024_05-3*.txt",
               "DeepLearningExamples ResNet-50 v1.5, synthetic data, NCHW, SGD; mean of 3 runs (1893.63, "
               "1893.41, 1892.55 train.total_ips). Lambda labels it FP32; PyTorch's default "
               "cudnn.allow_tf32=True runs the convolutions on TF32 tensor cores. Lambda's Feb 2023 run of "
               "the same test (NGC 22.10, results/H100_80GB_SXM5_v1) gave 1753 img/s."),
    Throughput("h100", "resnet50-224", 1280, "amp", 2682.2, "images/s", "PyTorch, NGC pytorch:24.10-py3",
               f"{_LAMBDA_PT} pytorch/results_v2/LambdaOD_1x_1xH100_80GB_SXM5_192-222-52-83_v2/"
               "PyTorch_resnet50_AMP/30-10-2024_05-*.txt",
               "DeepLearningExamples ResNet-50 v1.5, --amp, static loss scale 256, NCHW (not channels-last), "
               "synthetic data; mean of 3 runs (2681.79, 2682.55, 2682.19). Feb 2023 run (NGC 22.10): 2616."),
    Throughput("h100", "gnmt-v2", 1520, "amp", 483639.0, "tokens/s", "PyTorch, NGC pytorch:24.10-py3",
               f"{_LAMBDA_PT} pytorch/results_v2/LambdaOD_1x_1xH100_80GB_SXM5_192-222-52-83_v2/"
               "PyTorch_gnmt_FP16/30-10-2024_05-5*.txt",
               "DeepLearningExamples GNMT v2 (LSTM encoder-decoder, 1024 hidden, WMT16 en-de); batch in "
               "sentences; 'Performance: Epoch 1 Training' tok/s, mean of 3 runs (482011, 485213, 483692)"),
    Throughput("h100", "gnmt-v2", 1024, "tf32", 246339.0, "tokens/s", "PyTorch, NGC pytorch:24.10-py3",
               f"{_LAMBDA_PT} pytorch/results_v2/LambdaOD_1x_1xH100_80GB_SXM5_192-222-52-83_v2/"
               "PyTorch_gnmt_FP32/30-10-2024_06-0*.txt",
               "as the amp row; labelled FP32 by Lambda, counted as TF32 here (inferred, not stated): 11x the V100's "
               "FP32 figure (21860 tok/s, batch 128) on a card with 4.3x the FP32 CUDA-core rate; mean of 3 runs "
               "(246197, 246306, 246513)"),
    Throughput("h100", "bert-large-squad-384", 112, "amp", 321.0, "sequences/s", "PyTorch, NGC pytorch:24.10-py3",
               f"{_LAMBDA_PT} pytorch/results_v2/LambdaOD_1x_1xH100_80GB_SXM5_192-222-52-83_v2/"
               "PyTorch_bert_large_squad_FP16/",
               "DeepLearningExamples BERT-large SQuAD v1.1 fine-tuning, seq 384, apex O2 (FP16 with FP32 master "
               "weights); training_sequences_per_second, mean of 3 runs (321.01, 321.16, 320.89)"),
    Throughput("h100", "bert-large-squad-384", 64, "tf32", 140.6, "sequences/s", "PyTorch, NGC pytorch:24.10-py3",
               f"{_LAMBDA_PT} pytorch/results_v2/LambdaOD_1x_1xH100_80GB_SXM5_192-222-52-83_v2/"
               "PyTorch_bert_large_squad_FP32/",
               "as the amp row; labelled FP32, counted as TF32: ~0.7 TFLOP per sequence (6 x ~300M weights x 384 "
               "tokens) x 140/s is ~100 TFLOPS, above the 67 TFLOPS FP32 peak; mean of 3 runs (140.96, 140.25, "
               "140.59)"),
    # ---------------------------------------------------------------- V100 (SXM2 unless the note says)
    Throughput("v100", "resnet50-224", 112, "fp32", 367.0, "images/s", "PyTorch, NGC pytorch-21.03",
               f"{_DLE} PyTorch/Classification/ConvNets/resnet50v1.5/README.md, 'Training performance: NVIDIA "
               "DGX-1 16GB (8x V100 16GB)', 1 GPU; batch from PyTorch/Classification/ConvNets/configs.yml "
               "(resnet50 DGX1V FP32 batch_size 112)",
               "ResNet-50 v1.5, real ImageNet through DALI; V100 SXM2 16GB. The DGX-1 32GB table: 356 img/s."),
    Throughput("v100", "resnet50-224", 256, "amp", 1200.0, "images/s", "PyTorch, NGC pytorch-21.03",
               f"{_DLE} PyTorch/Classification/ConvNets/resnet50v1.5/README.md, DGX-1 16GB table, 1 GPU, mixed "
               "precision; batch from configs.yml (resnet50 DGX1V AMP batch_size 256, memory_format nhwc)",
               "ResNet-50 v1.5, channels-last (NHWC), DALI; V100 SXM2 16GB. The DGX-1 32GB table: 1156 img/s."),
    Throughput("v100", "transformer-big", 2560, "fp32", 8742.0, "tokens/s", "PyTorch (fairseq), NGC pytorch-22.06",
               f"{_DLE} PyTorch/Translation/Transformer/README.md, 'Training performance: NVIDIA DGX-1 (8x V100 "
               "16GB)', 1 GPU; batch from scripts/run_DGX1_FP32.sh (--max-tokens 2560)",
               "transformer_wmt_en_de_big_t2t on WMT14 en-de; batch is tokens per GPU (--max-tokens); averaged "
               "over an epoch. DGX-2 (V100 SXM3 32GB, run_DGX2_FP32.sh, 5120 tokens): 9827 tok/s."),
    Throughput("v100", "transformer-big", 5120, "amp", 32942.0, "tokens/s", "PyTorch (fairseq), NGC pytorch-22.06",
               f"{_DLE} PyTorch/Translation/Transformer/README.md, DGX-1 (8x V100 16GB) table, 1 GPU; batch from "
               "scripts/run_DGX1_AMP.sh (--max-tokens 5120, --amp)",
               "as the fp32 row; DGX-2 (V100 SXM3 32GB, run_DGX2_AMP.sh, 10240 tokens): 39911 tok/s."),
    Throughput("v100", "gnmt-v2", 128, "fp32", 21860.0, "tokens/s", "PyTorch, NGC pytorch-20.06",
               f"{_DLE} PyTorch/Translation/GNMT/README.md, 'Training throughput: NVIDIA DGX-1 (8x V100 16GB)', "
               "1 GPU",
               "GNMT v2 (LSTM encoder-decoder, 1024 hidden, WMT16 en-de); batch in sentences; averaged over an "
               "epoch. An LSTM NMT model, the nearest published kin of P3's Sockeye."),
    Throughput("v100", "gnmt-v2", 128, "amp", 76438.0, "tokens/s", "PyTorch, NGC pytorch-20.06",
               f"{_DLE} PyTorch/Translation/GNMT/README.md, DGX-1 (8x V100 16GB) table, 1 GPU, mixed precision",
               "as the fp32 row"),
    Throughput("v100", "resnet50-224", 32, "fp32", 298.51, "images/s", "MXNet 1.2.0.rc1, cuDNN 7.0.5", _MXNET_PERF,
               "example/image-classification/train_imagenet.py via mli/mxnet-benchmark run_vary_batch.sh; "
               "V100 of an EC2 p3.2xlarge (SXM2 16GB). Batch 32 is P3's per-GPU batch, MXNet is P3's framework."),
    Throughput("v100", "resnet50-224", 128, "fp32", 363.69, "images/s", "MXNet 1.2.0.rc1, cuDNN 7.0.5", _MXNET_PERF,
               "as the batch-32 row (batch 64: 343.19)"),
    Throughput("v100", "inception-v3-299", 32, "fp32", 214.48, "images/s", "MXNet 1.2.0.rc1, cuDNN 7.0.5",
               _MXNET_PERF, "as the ResNet-50 rows; Inception-v3 at 299x299 (batch 128: 253.68)"),
    Throughput("v100", "vgg16-224", 192, "fp32", 249.19, "images/s", "TensorFlow 2.2 tf_cnn_benchmarks",
               f"{_LAMBDA_TF} logs/Platinum-Tesla_V100-SXM3-32GB_HP16_TF2_2.logs/syn-replicated-fp32-1gpus/"
               "vgg16-192/throughput/1 ('total images/sec')",
               "card: Tesla V100-SXM3-32GB in a 16-GPU HGX-2/DGX-2-class server (driver 440.33.01): same 125 TF "
               "tensor rating per GPU as SXM2 in a DGX-2, up to ~5 % more in a 450 W DGX-2H (not stated); "
               "synthetic data, NCHW, SGD"),
    Throughput("v100", "vgg16-224", 384, "amp", 455.93, "images/s", "TensorFlow 2.2 tf_cnn_benchmarks",
               f"{_LAMBDA_TF} logs/Platinum-Tesla_V100-SXM3-32GB_HP16_TF2_2.logs/syn-replicated-fp16-1gpus/"
               "vgg16-384/throughput/1",
               "tf_cnn_benchmarks --use_fp16 (FP16 compute, FP32 master variables, loss scaling); card as the "
               "fp32 row"),
    Throughput("v100", "resnet50-224", 192, "fp32", 432.16, "images/s", "TensorFlow 2.2 tf_cnn_benchmarks",
               f"{_LAMBDA_TF} logs/Platinum-Tesla_V100-SXM3-32GB_HP16_TF2_2.logs/syn-replicated-fp32-1gpus/"
               "resnet50-192/throughput/1",
               "tf_cnn_benchmarks 'resnet50' is ResNet-50 v1 (stride on the 1x1 conv, ~5 % fewer FLOPs than "
               "v1.5); card as the vgg16 rows. 18 % above the DeepLearningExamples PyTorch v1.5 figure (367)."),
    Throughput("v100", "resnet50-224", 384, "amp", 1276.24, "images/s", "TensorFlow 2.2 tf_cnn_benchmarks",
               f"{_LAMBDA_TF} logs/Platinum-Tesla_V100-SXM3-32GB_HP16_TF2_2.logs/syn-replicated-fp16-1gpus/"
               "resnet50-384/throughput/1", "as the fp32 row, --use_fp16"),
    # ---------------------------------------------------------------- GeForce GTX TITAN X (Maxwell)
    Throughput("titanx-maxwell", "vgg16-224", 16, "fp32", _per_s(16, 192.78), "images/s", "Torch7 + cuDNN 5.1.05",
               f"{_JCJ}, VGG-16 table, row 'Maxwell Titan X | 5.1.05'",
               _JCJ_NOTE.format(ms=192.78, lib="CUDA 8.0 RC, dual Xeon E5-2630 v3 host. cuDNN 5.0.05: 262.27 ms; "
                                "cuDNN 4.0.07: 338.69 ms")),
    Throughput("titanx-maxwell", "vgg19-224", 16, "fp32", _per_s(16, 225.14), "images/s", "Torch7 + cuDNN 5.1.05",
               f"{_JCJ}, VGG-19 table, row 'Maxwell Titan X | 5.1.05'",
               _JCJ_NOTE.format(ms=225.14, lib="cuDNN 5.0.05: 322.81 ms; cuDNN 4.0.07: 418.22 ms")),
    Throughput("titanx-maxwell", "resnet50-224", 16, "fp32", _per_s(16, 159.62), "images/s", "Torch7 + cuDNN 5.1.05",
               f"{_JCJ}, ResNet-50 table, row 'Maxwell Titan X | 5.1.05'",
               _JCJ_NOTE.format(ms=159.62, lib="fb.resnet.torch ResNet-50 (stride on the 3x3 conv, as in v1.5). "
                                "cuDNN 5.0.05: 166.05 ms; cuDNN 4.0.07: 178.84 ms")),
    Throughput("titanx-maxwell", "googlenet-224", 16, "fp32", _per_s(16, 61.98), "images/s", "Torch7 + cuDNN 5.1.05",
               f"{_JCJ}, Inception-V1 table, row 'Maxwell Titan X | 5.1.05'",
               _JCJ_NOTE.format(ms=61.98, lib="soumith/inception.torch Inception-V1 (GoogLeNet)")),
    Throughput("titanx-maxwell", "googlenet-224", 128, "fp32", _per_s(128, 470.0), "images/s",
               "Torch7 + cuDNN R4 (fp32)", f"{_SOUMITH}, GoogleNet V1 table, row 'CuDNN[R4]-fp32 (Torch)'",
               "forward + backward of a batch of 128 (dropout and softmax left out), mean of 10 runs; 470 ms per "
               "batch converted. The card logs as 'GeForce GTX TITAN X', compute capability 5.2 "
               "(tensorflow/output_googlenet.log)."),
    Throughput("titanx-maxwell", "googlenet-224", 128, "fp32", _per_s(128, 445.0), "images/s",
               "TensorFlow (commit 55068f3, Apr 2016)", f"{_SOUMITH}, GoogleNet V1 table, row 'TensorFlow'",
               "forward-backward across 100 steps, 0.445 s per batch of 128 (tensorflow/output_googlenet.log)"),
    Throughput("titanx-maxwell", "vgg11-224", 64, "fp32", _per_s(64, 529.0), "images/s", "Torch7 + cuDNN R4 (fp32)",
               f"{_SOUMITH}, OxfordNet [Model-A] table, row 'CuDNN[R4]-fp32 (Torch)'",
               "VGG model A (11 weight layers), forward + backward, 529 ms per batch of 64 converted; "
               "TensorFlow on the same card: 540 ms"),
    # ---------------------------------------------------------------- GeForce GTX 1080 Ti (stand-in for SpecTrain)
    Throughput("1080ti", "vgg16-224", 16, "fp32", _per_s(16, 128.14), "images/s", "Torch7 + cuDNN 5.1.10",
               f"{_JCJ}, VGG-16 table, row 'GTX 1080 Ti | 5.1.10'",
               _JCJ_NOTE.format(ms=128.14, lib="CUDA 8.0, Core i7-7700 host. Pascal Titan X, cuDNN 5.1.05: "
                                "128.62 ms")),
    Throughput("1080ti", "vgg19-224", 16, "fp32", _per_s(16, 148.19), "images/s", "Torch7 + cuDNN 5.1.10",
               f"{_JCJ}, VGG-19 table, row 'GTX 1080 Ti | 5.1.10'",
               _JCJ_NOTE.format(ms=148.19, lib="Pascal Titan X, cuDNN 5.1.05: 147.32 ms")),
    Throughput("1080ti", "resnet50-224", 16, "fp32", _per_s(16, 101.21), "images/s", "Torch7 + cuDNN 5.1.10",
               f"{_JCJ}, ResNet-50 table, row 'GTX 1080 Ti | 5.1.10'",
               _JCJ_NOTE.format(ms=101.21, lib="fb.resnet.torch ResNet-50. Pascal Titan X, cuDNN 5.1.05: 103.58 ms")),
    Throughput("1080ti", "googlenet-224", 16, "fp32", _per_s(16, 36.87), "images/s", "Torch7 + cuDNN 5.1.10",
               f"{_JCJ}, Inception-V1 table, row 'GTX 1080 Ti | 5.1.10'",
               _JCJ_NOTE.format(ms=36.87, lib="soumith/inception.torch Inception-V1 (GoogLeNet)")),
    Throughput("1080ti", "vgg16-224", 56, "fp32", 124.79, "images/s", "TensorFlow 2.2 tf_cnn_benchmarks",
               f"{_LAMBDA_TF} logs/i7-6850K-GeForce_GTX_1080_Ti.logs/syn-replicated-fp32-1gpus/vgg16-56/"
               "throughput/1 ('total images/sec')",
               "full training step (SGD), synthetic data, NCHW; CUDA 10.0, driver 440.44, i7-6850K host"),
    Throughput("1080ti", "resnet50-224", 64, "fp32", 208.72, "images/s", "TensorFlow 2.2 tf_cnn_benchmarks",
               f"{_LAMBDA_TF} logs/i7-6850K-GeForce_GTX_1080_Ti.logs/syn-replicated-fp32-1gpus/resnet50-64/"
               "throughput/1", "ResNet-50 v1 (tf_cnn_benchmarks 'resnet50'); as the vgg16 row"),
    Throughput("1080ti", "inception-v3-299", 64, "fp32", 131.34, "images/s", "TensorFlow 2.2 tf_cnn_benchmarks",
               f"{_LAMBDA_TF} logs/i7-6850K-GeForce_GTX_1080_Ti.logs/syn-replicated-fp32-1gpus/inception3-64/"
               "throughput/1", "Inception-v3 at 299x299; as the vgg16 row"),
    Throughput("1080ti", "resnet50-224", 100, "fp32", 196.34, "images/s",
               "PyTorch, NGC pytorch:20.01-py3 (recommended)",
               f"{_LAMBDA_PT} pytorch/results/1080Ti/PyTorch_resnet50_FP32/03-03-2020_10-2*.txt",
               "DeepLearningExamples ResNet-50 v1.5, real ImageNet via DALI (dali-cpu); mean of 3 runs' "
               "Summary train.total_ips (195.78, 197.06, 196.18); the repo's README then recommended "
               "pytorch:20.01-py3 for pre-Ampere cards (the log does not name the container)"),
    # ---------------------------------------------------------------- GeForce GTX 1080 (sibling of the P4000)
    Throughput("gtx1080", "vgg16-224", 16, "fp32", _per_s(16, 182.79), "images/s", "Torch7 + cuDNN 5.1.05",
               f"{_JCJ}, VGG-16 table, row 'GTX 1080 | 5.1.05'",
               _JCJ_NOTE.format(ms=182.79, lib="CUDA 8.0 RC, dual Xeon E5-2630 v3 host")),
    Throughput("gtx1080", "vgg19-224", 16, "fp32", _per_s(16, 210.39), "images/s", "Torch7 + cuDNN 5.1.05",
               f"{_JCJ}, VGG-19 table, row 'GTX 1080 | 5.1.05'", _JCJ_NOTE.format(ms=210.39, lib="CUDA 8.0 RC")),
    Throughput("gtx1080", "resnet50-224", 16, "fp32", _per_s(16, 149.82), "images/s", "Torch7 + cuDNN 5.1.05",
               f"{_JCJ}, ResNet-50 table, row 'GTX 1080 | 5.1.05'",
               _JCJ_NOTE.format(ms=149.82, lib="fb.resnet.torch ResNet-50")),
)
