"""Training loops under torchrun for tests/integrations/test_multirank_loops.py. Each writes a
reference, a clean target and a target with a fault on rank 1 into OUT/{ref,clean,fault}.

    torchrun --nproc_per_node 2 dist_loops.py OUT api-ddp|api-fsdp|lightning-fsdp|trainer-ddp
"""
import os
import sys
from pathlib import Path

import torch
from torch import nn

from driftcheck.targets import faults

OUT, LOOP = Path(sys.argv[1]), sys.argv[2]
FAULTY = "net.2"


def fault_here(model, fault):
    if fault and os.environ.get("RANK") == "1":
        faults.scale_output(FAULTY, 1.2)(model)


def net():
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 4))


def api(parallel):
    """driftcheck.trace() in the user's own loop around DDP or FSDP2 (fully_shard)."""
    import torch.distributed as dist

    import driftcheck

    dist.init_process_group("gloo")
    for name, autocast, fault in (("ref", False, False), ("clean", True, False), ("fault", True, True)):
        torch.manual_seed(0)
        model = nn.Module()
        model.net = net()
        model.forward = lambda x, m=model: m.net(x)
        fault_here(model, fault)
        if parallel == "ddp":
            wrapped = nn.parallel.DistributedDataParallel(model)
        else:
            from torch.distributed.fsdp import fully_shard

            wrapped = fully_shard(model)
        opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(1 + dist.get_rank())
        with driftcheck.trace(wrapped, OUT / name, optimizer=opt, force=True,
                              run={"autocast": "bf16" if autocast else None}) as t:
            for _ in range(2):
                x = torch.randn(4, 8, generator=g)
                with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
                    loss = wrapped(x).float().pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                t.step(loss)
    dist.destroy_process_group()


def lightning_fsdp():
    """A LightningModule sharded with FSDP2 by Lightning's ModelParallelStrategy."""
    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard

    from driftcheck.integrations.lightning import DriftcheckCallback

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = net()

        def configure_model(self):
            mesh = self.device_mesh["data_parallel"]
            for layer in self.net:
                if any(True for _ in layer.parameters()):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

        def training_step(self, batch, idx):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    for name, precision, fault in (("ref", "32-true", False), ("clean", "bf16-mixed", False),
                                   ("fault", "bf16-mixed", True)):
        torch.manual_seed(0 if name == "ref" else 4)
        module = Module()
        fault_here(module, fault)
        g = torch.Generator().manual_seed(1)
        data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 4, (64,), generator=g))
        loader = torch.utils.data.DataLoader(data, batch_size=8)
        cb = DriftcheckCallback(OUT / name, steps=2, replay=None if name == "ref" else OUT / "ref", force=True)
        L.Trainer(max_steps=3, accelerator="cpu", devices=2, precision=precision, logger=False,
                  strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                  callbacks=[cb]).fit(module, loader)


def trainer_ddp():
    """A Hugging Face Trainer under torchrun: DDP (accelerate's MULTI_CPU, gloo)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    from driftcheck.integrations.transformers import DriftcheckCallback

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    for name, bf16, fault in (("ref", False, False), ("clean", True, False), ("fault", True, True)):
        torch.manual_seed(0 if name == "ref" else 4)
        model = LlamaForCausalLM(cfg)
        if fault and os.environ.get("RANK") == "1":
            faults.scale_output("model.layers.1.mlp", 1.2)(model)
        g = torch.Generator().manual_seed(1)
        data = [{"input_ids": (ids := torch.randint(0, 64, (12,), generator=g)), "labels": ids} for _ in range(32)]
        args = TrainingArguments(output_dir=str(OUT / f"trainer-{name}"), max_steps=2,
                                 per_device_train_batch_size=4, report_to=[], use_cpu=True, bf16=bf16,
                                 save_strategy="no", disable_tqdm=True, logging_strategy="no")
        cb = DriftcheckCallback(OUT / name, steps=2, replay=None if name == "ref" else OUT / "ref", force=True)
        Trainer(model=model, args=args, train_dataset=data, callbacks=[cb]).train()


if __name__ == "__main__":
    {"api-ddp": lambda: api("ddp"), "api-fsdp": lambda: api("fsdp"),
     "lightning-fsdp": lightning_fsdp, "trainer-ddp": trainer_ddp}[LOOP]()
    import torch.distributed as dist

    if dist.is_initialized():  # the Trainer and Lightning leave it: gloo's threads must not
        dist.barrier()         # outlive the interpreter ("terminate called without an active
        dist.destroy_process_group()  # exception" at exit)
