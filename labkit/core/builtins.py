"""The built-in methods and workloads as their classes declare them, for the processes that
do not import torch: the command line's flags, the report, the runs index (labkit.core.methods
and labkit.core.config read it). Written by `python tools/builtins.py` from the classes
(labkit.training.catalogue); tests/test_builtins.py holds it equal to them. Edit the classes,
never this file."""
# flake8: noqa: E501
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from .params import option

#: every built-in method, in the order of every table: its spec (what a result file
#: records of it) and what the launcher, the cost model and the report read of it
METHODS = {'ddp': {'spec': {'key': 'ddp',
                  'guide_name': 'Baseline DDP (PyTorch)',
                  'short': 'Baseline DDP',
                  'result_file': 'results_baseline_ddp.json',
                  'phases': [],
                  'serves': False,
                  'exact': True,
                  'source': 'labkit.training.sync.ddp:DDPStrategy',
                  'builtin': True,
                  'bound': False},
         'order': 0,
         'guide': True,
         'baseline': True,
         'default': True,
         'variants': {'ddp': {},
                      'ddp-fp16': {'compress': 'fp16'},
                      'ddp-bf16': {'compress': 'bf16'}},
         'bench_variants': ('ddp',),
         'preload': ('labkit.training.sync.ddp',
                     'torch.nn.parallel',
                     'torch.distributed.algorithms.ddp_comm_hooks.default_hooks'),
         'cost_model': 'ring',
         'options': ('find_unused_parameters',)},
 'allreduce': {'spec': {'key': 'allreduce',
                        'guide_name': 'Manual All-Reduce',
                        'short': 'Manual All-Reduce',
                        'result_file': 'results_all_reduce.json',
                        'phases': ['comm'],
                        'serves': False,
                        'exact': True,
                        'source': 'labkit.training.sync.allreduce:AllReduceStrategy',
                        'builtin': True,
                        'bound': False},
               'order': 1,
               'guide': True,
               'baseline': False,
               'default': True,
               'variants': {'allreduce': {}, 'allreduce-fp16': {'compress': 'fp16'}},
               'bench_variants': ('allreduce',),
               'preload': ('labkit.training.sync.allreduce',),
               'cost_model': 'ring',
               'options': ('bucket_mb', 'no_overlap')},
 'ps': {'spec': {'key': 'ps',
                 'guide_name': 'Parameter Server (PS)',
                 'short': 'Parameter Server',
                 'result_file': 'results_ps.json',
                 'phases': ['pull', 'push'],
                 'serves': True,
                 'exact': True,
                 'source': 'labkit.training.sync.ps:ParameterServer',
                 'builtin': True,
                 'bound': False},
        'order': 2,
        'guide': True,
        'baseline': False,
        'default': True,
        'variants': {'ps': {'ps_mode': 'collective'},
                     'ps-p2p': {'ps_mode': 'p2p'},
                     'ps-sharded': {'ps_mode': 'collective', 'ps_servers': 2},
                     'ps-async': {'ps_mode': 'collective', 'ps_staleness': 2},
                     'ps-fp16': {'ps_mode': 'collective', 'compress': 'fp16'}},
        'bench_variants': ('ps', 'ps-p2p'),
        'preload': ('labkit.training.sync.ps',),
        'cost_model': 'server',
        'options': ('bucket_mb', 'ps_mode', 'ps_servers', 'ps_staleness')},
 'nosync': {'spec': {'key': 'nosync',
                     'guide_name': 'No synchronisation (bound)',
                     'short': 'No sync (bound)',
                     'result_file': 'results_nosync.json',
                     'phases': [],
                     'serves': False,
                     'exact': False,
                     'source': 'labkit.training.sync.nosync:NoSync',
                     'builtin': True,
                     'bound': True},
            'order': 3,
            'guide': False,
            'baseline': False,
            'default': True,
            'variants': {},
            'bench_variants': (),
            'preload': ('labkit.training.sync.nosync',),
            'cost_model': '',
            'options': ()},
 'powersgd': {'spec': {'key': 'powersgd',
                       'guide_name': 'DDP with PowerSGD (PyTorch)',
                       'short': 'PowerSGD',
                       'result_file': 'results_powersgd.json',
                       'phases': [],
                       'serves': False,
                       'exact': False,
                       'source': 'labkit.training.sync.powersgd:PowerSGD',
                       'builtin': True,
                       'bound': False},
              'order': 4,
              'guide': False,
              'baseline': False,
              'default': False,
              'variants': {},
              'bench_variants': (),
              'preload': ('labkit.training.sync.powersgd',
                          'torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook'),
              'cost_model': '',
              'options': ('find_unused_parameters', 'powersgd_rank', 'powersgd_start_iter')},
 'localsgd': {'spec': {'key': 'localsgd',
                       'guide_name': 'Local SGD',
                       'short': 'Local SGD',
                       'result_file': 'results_localsgd.json',
                       'phases': ['comm'],
                       'serves': False,
                       'exact': False,
                       'source': 'labkit.training.sync.local_sgd:LocalSGD',
                       'builtin': True,
                       'bound': False},
              'order': 5,
              'guide': False,
              'baseline': False,
              'default': False,
              'variants': {},
              'bench_variants': (),
              'preload': ('labkit.training.sync.local_sgd',),
              'cost_model': '',
              'options': ('local_steps',)},
 'diloco': {'spec': {'key': 'diloco',
                     'guide_name': 'DiLoCo',
                     'short': 'DiLoCo',
                     'result_file': 'results_diloco.json',
                     'phases': ['comm'],
                     'serves': False,
                     'exact': False,
                     'source': 'labkit.training.sync.diloco:DiLoCo',
                     'builtin': True,
                     'bound': False},
            'order': 6,
            'guide': False,
            'baseline': False,
            'default': False,
            'variants': {},
            'bench_variants': (),
            'preload': ('labkit.training.sync.diloco',),
            'cost_model': '',
            'options': ('local_steps', 'outer_lr', 'outer_momentum')},
 'fsdp': {'spec': {'key': 'fsdp',
                   'guide_name': 'FSDP2 (PyTorch fully_shard)',
                   'short': 'FSDP',
                   'result_file': 'results_fsdp.json',
                   'phases': [],
                   'serves': False,
                   'exact': True,
                   'source': 'labkit.training.sync.fsdp:FSDP',
                   'builtin': True,
                   'bound': False},
          'order': 7,
          'guide': False,
          'baseline': False,
          'default': False,
          'variants': {'fsdp': {},
                       'fsdp-zero2': {'reshard_after_forward': False},
                       'hsdp': {'fsdp_replicas': 2}},
          'bench_variants': (),
          'preload': ('labkit.training.sync.fsdp',
                      'torch.distributed.fsdp',
                      'torch.distributed.checkpoint.state_dict',
                      'torch.distributed.device_mesh'),
          'cost_model': 'sharded',
          'options': ('reshard_after_forward', 'fsdp_units', 'fsdp_bf16', 'fsdp_replicas')},
 'zero3': {'spec': {'key': 'zero3',
                    'guide_name': 'Manual fully sharded (ZeRO-3)',
                    'short': 'Manual ZeRO-3',
                    'result_file': 'results_zero3.json',
                    'phases': ['gather', 'reduce'],
                    'serves': False,
                    'exact': True,
                    'source': 'labkit.training.sync.zero3:ManualFullySharded',
                    'builtin': True,
                    'bound': False},
           'order': 8,
           'guide': False,
           'baseline': False,
           'default': False,
           'variants': {},
           'bench_variants': (),
           'preload': ('labkit.training.sync.zero3',),
           'cost_model': 'sharded',
           'options': ()}}

#: every built-in workload: where its class lives, its preloads and options
WORKLOADS = {'images': {'source': 'labkit.workloads.images:Images',
            'default': True,
            'preload': ('torchvision',
                        'labkit.workloads.images.models',
                        'labkit.workloads.images.image_sets'),
            'worker_preload': ('torchvision.datasets',
                               'torchvision.transforms',
                               'labkit.workloads.images.image_sets',
                               'labkit.workloads.images.jpeg_files'),
            'options': ('num_classes',
                        'image_size',
                        'synthetic_samples',
                        'skip_bad_images',
                        'decode')},
 'lm': {'source': 'labkit.workloads.lm:LanguageModel',
        'default': False,
        'preload': ('labkit.workloads.lm.model', 'labkit.workloads.lm.corpus'),
        'worker_preload': (),
        'options': ('seq_len',)}}

#: the methods' variants: name -> the TrainConfig fields that make it
VARIANTS = {'ddp': {'method': 'ddp'},
 'allreduce': {'method': 'allreduce'},
 'ps': {'method': 'ps', 'ps_mode': 'collective'},
 'fsdp': {'method': 'fsdp'},
 'ddp-fp16': {'method': 'ddp', 'compress': 'fp16'},
 'ddp-bf16': {'method': 'ddp', 'compress': 'bf16'},
 'allreduce-fp16': {'method': 'allreduce', 'compress': 'fp16'},
 'ps-p2p': {'method': 'ps', 'ps_mode': 'p2p'},
 'ps-sharded': {'method': 'ps', 'ps_mode': 'collective', 'ps_servers': 2},
 'ps-async': {'method': 'ps', 'ps_mode': 'collective', 'ps_staleness': 2},
 'ps-fp16': {'method': 'ps', 'ps_mode': 'collective', 'compress': 'fp16'},
 'fsdp-zero2': {'method': 'fsdp', 'reshard_after_forward': False},
 'hsdp': {'method': 'fsdp', 'fsdp_replicas': 2}}
#: the variants labkit bench times without --variants
BENCH_VARIANTS = ('ddp', 'allreduce', 'ps', 'ps-p2p')


@dataclass
class BuiltinOptions:
    """Every built-in method's and workload's options, flat, as TrainConfig holds them."""
    # ddp, powersgd
    find_unused_parameters: bool = option(
        False, 'let the model have parameters that a step gives no gradient (a forward that '
        'uses some layers on some batches only): ddp and powersgd pass it to DDP, '
        'which then walks the autograd graph from the outputs after every forward to '
        'find them, a cost each step (the other methods need no flag for them). '
        'Without it the check before a run refuses such a model, naming them',
        'method')
    # allreduce, ps
    bucket_mb: float = option(
        25.0, 'allreduce and ps collective: gradient bucket size in MiB (the first bucket, '
        'the first gradients backward produces, at most 1 MiB as in DDP)',
        'method', positive=True)
    # allreduce
    no_overlap: bool = option(
        False, 'allreduce: all-reduce after backward instead of overlapping it',
        'method')
    # ps
    ps_mode: Literal['collective', 'p2p'] = option(
        'collective', "ps: collective (flat reduce + broadcast) or p2p (the guide's per-tensor "
        'send/recv)',
        'method')
    # ps
    ps_servers: int = option(
        1, 'ps: server ranks (0..K-1); K > 1 shards the flattened parameters across '
        'them, each server owning one slice (collective mode)',
        'method', at_least=1)
    # ps
    ps_staleness: Optional[int] = option(
        None, "ps: asynchronous with bounded staleness S: the server applies each worker's "
        'gradient as it arrives and a worker runs at most S steps ahead of the '
        'slowest (default: synchronous)',
        'method', at_least=0)
    # powersgd
    powersgd_rank: int = option(
        2, 'powersgd: rank of the low-rank approximation of each gradient matrix '
        "(PowerSGDState's matrix_approximation_rank; 2 matched SGD's accuracy on "
        'CIFAR-10 ResNets in Vogels et al., 2019)',
        'method', at_least=1)
    # powersgd
    powersgd_start_iter: int = option(
        10, 'powersgd: steps of plain all-reduce before compression starts '
        "(PowerSGDState's start_powerSGD_iter; at least 2)",
        'method')
    # localsgd, diloco
    local_steps: int = option(
        8, 'localsgd and diloco: local optimizer steps H between two synchronisations '
        '(no gradient communication in between)',
        'method', at_least=1)
    # diloco
    outer_lr: float = option(
        0.7, "diloco: the outer optimizer's learning rate (Nesterov SGD on the averaged "
        'parameter change; 0.7 as in Douillard et al., 2023)',
        'method', positive=True)
    # diloco
    outer_momentum: float = option(
        0.9, "diloco: the outer optimizer's Nesterov momentum (0.9 as in Douillard et al., "
        '2023)',
        'method', at_least=0, below=1)
    # fsdp
    reshard_after_forward: bool = option(
        True, "fsdp: free each unit's gathered parameters after its forward and gather them "
        "again in backward (ZeRO-3, FSDP2's default); --no-reshard-after-forward "
        'keeps them until its backward: one all-gather a step, the whole parameters '
        'held meanwhile (ZeRO-2)',
        'method')
    # fsdp
    fsdp_units: Optional[str] = option(
        None, "fsdp: the modules sharded one by one, comma-separated names as the model's "
        "named_modules() gives them (default: the workload's units, e.g. "
        'blocks.0,blocks.1 for lm, layer1,...,layer4 for images); an empty list '
        'shards the whole model as one unit',
        'method')
    # fsdp
    fsdp_bf16: bool = option(
        False, 'fsdp: gather the parameters in bf16 for forward and backward and reduce the '
        "gradients in fp32 (FSDP2's MixedPrecisionPolicy, as torchtitan); on a GPU "
        'only',
        'method')
    # fsdp
    fsdp_replicas: int = option(
        1, "fsdp: HSDP's replicas R (torchtitan's data_parallel_replicate_degree): each "
        "parameter sharded over a group of world/R consecutive ranks, one node's "
        "where that is a node's ranks, and replicated across the R groups; the "
        'gradients reduce-scattered in a group and all-reduced across the replicas; '
        '1: sharded over every rank (FSDP)',
        'method', at_least=1)
    # images
    num_classes: int = option(
        1000, 'classes of the synthetic dataset',
        'data')
    # images
    image_size: Optional[int] = option(
        None, 'image side the model sees: digits are upsampled to it (default 16, twice the '
        "scans' 8x8; at most 224), synthetic images drawn at it and imagefolder "
        'images cropped to it (default 32 for _small models, else 224)',
        'data')
    # images
    synthetic_samples: int = option(
        2048, 'training samples in the synthetic dataset (val: a quarter)',
        'data')
    # images
    skip_bad_images: bool = option(
        False, 'imagefolder: leave out images PIL cannot open or verify (truncated, not '
        'images, unreadable) with a warning, instead of stopping with an error naming '
        'them',
        'data')
    # images
    decode: Optional[Literal['gpu', 'cpu']] = option(
        None, 'imagefolder: where JPEGs are decoded and augmented: gpu (loader workers read '
        "the files, torchvision's nvJPEG decoder and the transforms run on the GPU) "
        'or cpu (PIL in the loader workers); default: gpu on a GPU, else cpu',
        'data')
    # lm
    seq_len: Optional[int] = option(
        None, "lm: tokens in a sample's context window (default: by the model's width: 64 "
        'up to d 64 (tiny), 256 up to d 384 (small, shakespeare), else 1024 (gpt2))',
        'data', at_least=1)
