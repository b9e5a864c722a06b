"""Tensor, pipeline and expert parallelism on torch.distributed (gloo on the CPU, NCCL on GPUs).

- layout.py           ranks -> (stage, shard), each stage's layers, the checks made before any process starts
- groups.py           process-group start (localhost TCP or torchrun's env://), the tensor-parallel groups
- tensor_parallel.py  the TP transform applied after the model is built: column/row shards, vocab-parallel
                      embedding and head
- expert_parallel.py  the EP transform applied after it: a mixture's routed experts split over the ranks,
                      tokens sent to them and back by all-to-all
- pipeline.py         a stage's slice of the model and its forward, micro-batch by micro-batch (hidden
                      states handed on with asynchronous point-to-point sends)
- microbatch.py       where rank 0 cuts a pipeline step, and each micro-batch's slice of the step
- plan.py             each step's plan as int64 tensors, broadcast from rank 0
- launcher.py         worker processes (torch.multiprocessing), liveness, shutdown, a parked group for reuse
- link_probe.py       this machine's gloo all-reduce and all-to-all times per size (the cost model's local link)

The engine calls this package (engine/parallel_executor.py, engine/parallel_worker.py); the model never
knows it is sharded.
"""
