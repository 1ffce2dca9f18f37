"""Pretrain a GPT with GTP from plain Python: ``llm.GPTModel`` + a GPT datamodule +
``nl.Trainer(strategy=GTPMegatronStrategy(...))``.

    # 2 GPUs, TP1 · GTP2:
    python examples/pretrain_gpt.py --devices 2 --num-weight-shards 2
    # 4 CPU processes (gloo), TP1 · GTP2 · DP2:
    python examples/pretrain_gpt.py --cpu --devices 4 --num-weight-shards 2

On GPUs the model takes NeMo's default layer spec (TransformerEngine's linears, built as their
GTP shards); on CPU megatron's local one (TE needs CUDA).
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--num-weight-shards", type=int, default=2, help="TP x GTP")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--cpu", action="store_true", help="CPU/gloo via nemo_gtp.cpu.compat")
    args = parser.parse_args()
    if args.cpu:
        from nemo_gtp.cpu.compat import enable_cpu_compat

        enable_cpu_compat(nemo=True)

    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from nemo import lightning as nl
    from nemo.collections import llm
    from nemo.collections.common.tokenizers.null_tokenizer import NullTokenizer
    from nemo.collections.llm.gpt.model.base import local_layer_spec

    from nemo_gtp import GTPMegatronStrategy
    from nemo_gtp.data.synthetic import ArithmeticGPTDataModule
    from nemo_gtp.engine import GTPConfig

    vocab, seq = 1024, 128
    extra = {}
    if args.cpu:
        from nemo_gtp.cpu.compat import cpu_gpt_data_step

        extra = dict(
            use_cpu_initialization=True,
            data_step_fn=cpu_gpt_data_step,
            transformer_layer_spec=local_layer_spec,
        )
    config = llm.GPTConfig(
        num_layers=4,
        hidden_size=256,
        ffn_hidden_size=1024,
        num_attention_heads=8,
        seq_length=seq,
        vocab_size=vocab,
        params_dtype=torch.float32,
        add_bias_linear=False,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        cross_entropy_loss_fusion=False,
        gradient_accumulation_fusion=False,
        **extra,
    )
    tokenizer = NullTokenizer(vocab - 1)
    optim = nl.MegatronOptimizerModule(
        config=OptimizerConfig(
            optimizer="adam", lr=1e-3, clip_grad=1.0, use_distributed_optimizer=True
        )
    )
    model = llm.GPTModel(config, tokenizer=tokenizer, optim=optim)
    data_parallel = args.devices // args.tp  # DP x GTP: every GTP peer eats its own microbatch
    data = ArithmeticGPTDataModule(
        seq_length=seq,
        tokenizer=tokenizer,
        micro_batch_size=4,
        global_batch_size=4 * data_parallel,
        num_workers=0,
        pin_memory=False,
        create_attention_mask=True,
    )
    strategy = GTPMegatronStrategy(
        tensor_model_parallel_size=args.tp,
        num_weight_shards=args.num_weight_shards,
        gtp_config=GTPConfig(pad_for_alignment=16),
        ddp=DistributedDataParallelConfig(
            use_distributed_optimizer=True, overlap_grad_reduce=True, grad_reduce_in_fp32=True
        ),
        ckpt_async_save=False,
        **({"process_group_backend": "gloo"} if args.cpu else {}),
    )
    trainer = nl.Trainer(
        accelerator="cpu" if args.cpu else "gpu",
        devices=args.devices,
        max_steps=args.steps,
        strategy=strategy,
        log_every_n_steps=1,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        logger=False,
        use_distributed_sampler=False,
    )
    trainer.fit(model, datamodule=data)


if __name__ == "__main__":
    main()
