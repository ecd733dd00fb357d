"""The four papers' setups and headline claims, as far as their texts and artifacts could be read."""

from __future__ import annotations

__all__ = ["PAPERS"]

# What each paper states about its hardware and workloads. "status" says how a fact was read:
#   "verified"   - read in the paper's abstract/proceedings page or the authors' own artifact;
#   "secondary"  - read in a third party's summary of the paper, not in the paper itself;
#   "unverified" - the brief's or our recollection; the paper text was not available to check.
PAPERS: dict[str, dict] = {
    "p3": {
        "title": "Priority-based Parameter Propagation for Distributed DNN Training",
        "authors": "Anand Jayarajan, Jinliang Wei, Garth Gibson, Alexandra Fedorova, Gennady Pekhimenko",
        "venue": "SysML 2019 (Proceedings of Machine Learning and Systems 1, pp. 132-145); arXiv 1905.03960",
        "citation": ("https://proceedings.mlsys.org/paper_files/paper/2019/hash/"
                     "3ed923f9f88108cb066c6568d3df2666-Abstract.html; artifact https://github.com/anandj91/p3 "
                     "(run_exp.sh), reproduction https://github.com/ctuning/reproduce-sysml19-paper-p3"),
        "gpu": "p4000",
        "gpu_status": ("secondary: a third-party reading note of the paper (GitHub file found by find_string, "
                       "id 55680967910) gives '4 machines, P4000 GPU, 100Gbps InfiniBand + tc throttling'; "
                       "matches the brief; the paper's own setup section was not available here"),
        "cluster": {"machines": 4, "gpus_per_machine": 1,
                    "status": ("artifact: run_exp.sh trains on one GPU per machine (--gpus 0) of N hosts, MXNet "
                               "--kv-store dist_device_sync; ctuning README: 'more than one machine (four "
                               "recommended)'; 4 machines also per the secondary note")},
        "interconnect": ("100 Gbps InfiniBand, throttled (tc) to lower bandwidths [secondary]; the artifact's "
                         "default interface is ib1 (IP over InfiniBand) and it asks for 'at least 10 Gbps' "
                         "[verified]; an 8-node AWS g3.4xlarge (Tesla M60) run is also reported [secondary]"),
        "framework": "MXNet (modified KVStore / ps-lite parameter server)",
        "models": {
            "resnet50-224": {"batch_per_gpu": 32, "status": "artifact default (run_exp.sh BATCH=32, 3x224x224)"},
            "inception-v3-299": {"batch_per_gpu": 32, "status": "artifact default (3x299x299)"},
            "vgg19-224": {"batch_per_gpu": 32, "status": "artifact default (3x224x224)"},
            "sockeye-lstm-iwslt15": {"batch_per_gpu": 32,
                                     "status": ("artifact default; Sockeye 1.5 RNN: 2+2 LSTM layers, 512 hidden, "
                                                "512 embeddings, MLP attention, IWSLT15 en-vi, bucket width 10")},
        },
        "batch_note": ("The artifact's batch is 32 for every model (ctuning README: 'default batch size (32)'); "
                       "whether the paper's figures all used 32 was not verified."),
        "claims": (
            {"claim": ("P3 improves training throughput of ResNet-50, Sockeye and VGG-19 by as much as 25 %, 38 % "
                       "and 66 % on clusters with realistic network bandwidth"),
             "where": "abstract", "status": "verified"},
            {"claim": "ResNet-50: largest gain ~26 % at 4 Gbps", "where": "evaluation figure (number not read)",
             "status": "secondary"},
            {"claim": "VGG-19: largest gain 66 % at 15 Gbps", "where": "evaluation figure (number not read)",
             "status": "secondary"},
            {"claim": "VGG-19: parameter slicing alone gives 49 % at 30 Gbps",
             "where": "evaluation figure (number not read)", "status": "secondary"},
            {"claim": "VGG-19 on 8 AWS g3.4xlarge nodes: scaling efficiency up 61 %",
             "where": "evaluation (number not read)", "status": "secondary"},
        ),
    },
    "poseidon": {
        "title": "Poseidon: An Efficient Communication Architecture for Distributed Deep Learning on GPU Clusters",
        "authors": ("Hao Zhang, Zeyu Zheng, Shizhen Xu, Wei Dai, Qirong Ho, Xiaodan Liang, Zhiting Hu, Jinliang "
                    "Wei, Pengtao Xie, Eric P. Xing"),
        "venue": "USENIX ATC 2017; arXiv 1706.03292",
        "citation": ("https://www.usenix.org/conference/atc17/technical-sessions/presentation/zhang; release "
                     "docs http://poseidon-release.readthedocs.io/en/v0.10/"),
        "gpu": "titanx-maxwell",
        "gpu_status": ("secondary: a third-party summary of the paper (rajatbisht.net/paper_summaries/"
                       "block-diagram/0041_Poseidon.html) describes 'Titan X cluster + 40/30/20/10/5/2 GbE'. "
                       "Maxwell vs Pascal not read in the paper: Maxwell is the brief's reading; a Pascal TITAN X "
                       "(Aug 2016) would be ~1.5x faster (jcjohnson: 1.47x-1.60x)"),
        "cluster": {"machines": "up to 32", "gpus_per_machine": 1,
                    "status": "verified: the abstract speaks of 16 and 32 'single-GPU machines'"},
        "interconnect": ("Ethernet: 10GbE in the headline claim [verified, abstract]; a 40GbE switch with the "
                         "bandwidth varied over 40/30/20/10/5/2 GbE [secondary]"),
        "framework": "Caffe and TensorFlow (Poseidon plugged into both)",
        "models": {
            "inception-v3-299": {"batch_per_gpu": 32, "params": "27M",
                                 "status": "Poseidon TF-0.10 release docs table 'Batchsize (single node)'"},
            "vgg19-224": {"batch_per_gpu": 32, "params": "143M", "status": "release docs table"},
            "vgg19-22k-224": {"batch_per_gpu": 32, "params": "229M",
                              "status": "release docs table (written there as 'VGG12-22k', 229M parameters)"},
            "resnet152-224": {"batch_per_gpu": 32, "params": "60.2M", "status": "release docs table"},
            "googlenet-224": {"batch_per_gpu": 128, "params": "5M",
                              "status": "unverified (recollection of the paper's Table 3; not found in a source)"},
            "cifar10-quick": {"batch_per_gpu": 100,
                              "status": "unverified (recollection of the paper's Table 3; not found in a source)"},
        },
        "batch_note": "The release docs' batches are for the TensorFlow 0.10 build; the paper's Table 3 was not read.",
        "claims": (
            {"claim": ("Caffe and TensorFlow reach 15.5x speed-up on 16 single-GPU machines, even with limited "
                       "bandwidth (10GbE), on VGG19-22K"), "where": "abstract", "status": "verified"},
            {"claim": ("Poseidon-enabled TensorFlow: 31.5x speed-up with 32 single-GPU machines on Inception-V3, "
                       "50 % better than open-source TensorFlow (20x)"), "where": "abstract", "status": "verified"},
            {"claim": "VGG19-22K: near-linear, 30x on 32 nodes; distributed TensorFlow sometimes scales negatively",
             "where": "Poseidon v0.10 release docs, 'Performance at a Glance'", "status": "verified"},
        ),
    },
    "mstopk": {
        "title": "Towards Scalable Distributed Training of Deep Learning on Public Cloud Clusters",
        "authors": "Shaohuai Shi, Xianhao Zhou, Shutao Song, Xingyao Wang, ..., Yongjian Wu, Xiaowen Chu (24 authors)",
        "venue": "MLSys 2021; arXiv 2010.10458 (introduces the MSTopK operator and the HiTopKComm library)",
        "citation": "https://arxiv.org/abs/2010.10458",
        "gpu": "v100",
        "gpu_status": ("verified: 'a 16-node Tencent Cloud cluster (each node with 8 Nvidia Tesla V100 GPUs)' "
                       "(abstract). The variant (SXM2 NVLink 32GB is our recollection) was not verified."),
        "cluster": {"machines": 16, "gpus_per_machine": 8, "status": "verified (abstract)"},
        "interconnect": ("25 Gbps VPC (Ethernet) between instances [verified: Tencent's own account of the "
                         "DAWNBench record: 128 V100 GPUs on a 25 Gbps VPC network]; intra-node NVLink not verified"),
        "framework": "not verified from the paper (Tencent's record write-up names its 'Light' training framework)",
        "models": {
            "resnet50-224": {"batch_per_gpu": None,
                             "status": "named (DAWNBench ImageNet record); per-GPU batch not found"},
            "transformer": {"batch_per_gpu": None, "status": "'CNNs and Transformer' (abstract); batch not found"},
            "vgg19-224": {"batch_per_gpu": None,
                          "status": "unverified: in the brief, not confirmed from the paper"},
        },
        "batch_note": "Per-GPU batch sizes were not found in any source available here.",
        "claims": (
            {"claim": "25 %-40 % faster than existing state-of-the-art systems on CNNs and Transformer",
             "where": "abstract (16 nodes x 8 V100)", "status": "verified"},
            {"claim": "breaks the DAWNBench record for training ResNet-50 to 93 % top-5 on ImageNet",
             "where": "abstract", "status": "verified"},
            {"claim": ("2 min 31 s on 128 V100 GPUs (16 nodes), 28 epochs, 93 % top-5, 25 Gbps VPC; 2 min 2 s "
                       "projected with RoCE"),
             "where": "Tencent write-up (mo4tech.com / besthub.dev, 'Refresh training ImageNet world record')",
             "status": "verified (secondary to the paper: the vendor's own account)"},
        ),
    },
    "spectrain": {
        "title": "Efficient and Robust Parallel DNN Training through Model Parallelism on Multi-GPU Platform",
        "authors": "Chi-Chung Chen, Chia-Lin Yang, Hsiang-Yun Cheng",
        "venue": "arXiv 1809.02839 (v1 Sep 2018; v4 in MLSys/ICML style)",
        "citation": ("https://arxiv.org/abs/1809.02839; official PyTorch re-implementation "
                     "https://github.com/ntueclab/SpecTrain-PyTorch (the paper's own code was TensorFlow)"),
        "gpu": "1080ti",
        "gpu_status": ("unverified: the paper's setup section was not available here. The brief believes 4x "
                       "TITAN-class or GTX 1080 Ti; 1080ti is a stand-in (the Pascal TITAN X/Xp are the same "
                       "GP102 die, within a few % of it)"),
        "cluster": {"machines": 1, "gpus_per_machine": 4, "status": "verified: 'a 4-GPU platform' (abstract)"},
        "interconnect": "one machine, GPUs presumably on PCIe; not verified",
        "framework": "TensorFlow (paper); PyTorch re-implementation on PipeDream's runtime",
        "models": {
            "vgg16-cifar10": {"batch_per_gpu": 128,
                              "status": "re-implementation scripts (-b 128, 2 or 4 GPUs), not the paper"},
            "resnet50-cifar10": {"batch_per_gpu": 128, "status": "re-implementation scripts"},
            "densenet121-cifar10": {"batch_per_gpu": None, "status": "re-implementation README (batch not read)"},
            "googlenet-cifar10": {"batch_per_gpu": None, "status": "re-implementation README (batch not read)"},
            "transformer-imdb": {"batch_per_gpu": None, "status": "re-implementation README (sentiment analysis)"},
            "residual-lstm-imdb": {"batch_per_gpu": None, "status": "re-implementation README (sentiment analysis)"},
        },
        "batch_note": ("In the pipelined runs the batch is the pipeline's mini-batch, not a per-GPU data-parallel "
                       "batch; the paper's own batch sizes were not read."),
        "claims": (
            {"claim": ("up to 8.91x speed-up over data parallelism on a 4-GPU platform with comparable model "
                       "accuracy"), "where": "abstract (arXiv v4)", "status": "verified"},
            {"claim": ("up to 15.77x over data parallelism and 2.18x over the state-of-the-art model parallelism "
                       "method, without accuracy loss"), "where": "abstract of an earlier arXiv version",
             "status": "verified (catalyzex.com author page quotes it)"},
            {"claim": ("re-implementation accuracies, CIFAR-10, 4 GPUs: SpecTrain v1 VGG 88.11 % vs data "
                       "parallel (2 GPUs) 91.10 %; ResNet 89.15 vs 90.08; Transformer (IMDb) 79.71 vs 81.12"),
             "where": "ntueclab/SpecTrain-PyTorch README, 'Experiments' table", "status": "verified"},
        ),
    },
}
