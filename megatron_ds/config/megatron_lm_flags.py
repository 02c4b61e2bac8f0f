"""Upstream Megatron-LM's flags that megatron_ds answers without a field of its own: those it ignores
(an implementation of the same math, a communication or monitoring knob, a flag read only by a feature
that is refused) and those it refuses in one line saying what to use instead.

Megatron-LM (NVIDIA/Megatron-LM, tag core_v0.19.0, megatron/training/arguments.py and the config dataclasses
its ``ArgumentGroupFactory`` turns into flags) declares some 800 flags; tests/config/megatron_lm_flags.py
lists them all and tests/config/test_megatron_lm_flags.py checks that each one is accepted with its meaning,
ignored with a reason or refused here. The flags Megatron-LM shares with Megatron-DeepSpeed, and those whose
meaning megatron_ds implements, are fields of ``schema.py`` like any other.

A flag is written ``--flag`` (a switch), ``--flag=`` (one value), ``--flag=+`` / ``--flag=*`` (a list).
"""
from __future__ import annotations

IGNORED, REFUSED = "ignored", "refused"

# (ignored | refused, why / what to use instead, the flags)
_TABLE: tuple[tuple[str, str, str], ...] = (
    (IGNORED,
      "selects Transformer Engine's or a fused kernel's implementation of the same math; megatron_ds's own "
      'layers run here (kernels logged at start-up)',
      '--use-transformer-engine-op-fuser --fused-residual-rmsnorm --use-fused-weighted-squared-relu '
      '--use-te-activation-func --disable-jit-fuser --te-rng-tracker --flash-attention-version= '
      '--use-kitchen-attention --kitchen-attention-backend= --moe-permute-fusion --moe-router-fusion '
      '--mla-down-proj-fusion --no-clone-scatter-output-in-embedding '
      '--disable-clone-scatter-output-in-embedding --keep-fp8-transpose-cache '
      '--use-grouped-gemm-for-dense-mlp --use-grouped-gemm-for-shared-expert'),
    (IGNORED,
      "a communication-overlap or placement knob of Megatron-LM's own tensor/pipeline/data parallel code; "
      'the same values reach the same ranks here',
      '--tp-comm-overlap --no-tp-comm-bulk-wgrad --disable-tp-comm-bulk-wgrad --no-tp-comm-bulk-dgrad '
      '--disable-tp-comm-bulk-dgrad --no-tp-comm-overlap-ag --disable-tp-comm-overlap-ag '
      '--no-tp-comm-overlap-rs --disable-tp-comm-overlap-rs --tp-comm-overlap-rs-dgrad --no-tp-comm-split-ag '
      '--disable-tp-comm-split-ag --no-tp-comm-split-rs --disable-tp-comm-split-rs --tp-comm-bootstrap-backend= '
      '--tp-comm-overlap-cfg= --pipeline-model-parallel-comm-backend= --overlap-moe-expert-parallel-comm '
      '--moe-shared-expert-overlap '
      '--delay-wgrad-compute --overlap-dispatch-backward-with-experts-wgrad '
      '--ep-overlap-early-attn-memory-release --defer-embedding-wgrad-compute --wgrad-deferral-limit= '
      '--overlap-p2p-communication-warmup-flush --high-priority-a2a-comm-stream --no-overlap-p2p-communication '
      '--no-align-grad-reduce --disable-align-grad-reduce --overlap-param-gather-with-optimizer-step '
      '--no-align-param-gather --ddp-num-buckets= --ddp-pad-buckets-for-high-nccl-busbw '
      '--ddp-average-in-collective --no-gradient-reduce-div-fusion --no-use-layer-wise-param-layout '
      '--create-all-gather-group --suggested-communication-unit-size= --use-nccl-ub '
      '--disable-symmetric-registration --fsdp-manual-registration --high-priority-stream-groups=+ --use-sharp '
      '--sharp-enabled-group= --nccl-communicator-config-path= --disable-gloo-process-groups '
      '--use-tp-pp-dp-mapping --fsdp-double-buffer --fsdp-db-use-persist-buf-on-alloc-fail '
      '--megatron-fsdp-enable-fine-grained-param-gather --megatron-fsdp-max-pool-double-buffer '
      '--optimizer-cuda-graph --overlap-cpu-optimizer-d2h-h2d --no-pin-cpu-grads --no-pin-cpu-params '
      '--reuse-grad-buf-for-mxfp8-param-ag'),
    (IGNORED,
      'CUDA graphs replay the same kernels; they are not captured here',
      '--enable-cuda-graph --cuda-graph-warmup-steps= --external-cuda-graph --cuda-graph-impl= '
      '--cuda-graph-scope=+ --cuda-graph-modules=+'),
    (IGNORED,
      'a monitoring, tracing or telemetry integration of Megatron-LM (NVIDIA one-logger, nvtx, flight '
      'recorder, energy); training is unchanged',
      '--no-one-logger --one-logger-project= --one-logger-run-name= --one-logger-async --app-tag-run-name= '
      '--app-tag-run-version= --run-workload-inspector-server --nvtx-ranges --record-memory-history '
      '--memory-snapshot-path= --record-shapes --pytorch-profiler-collect-shapes '
      '--pytorch-profiler-collect-callstack --pytorch-profiler-collect-chakra --flight-recorder-dump-path= '
      '--flight-recorder-trace-buffer-size= --no-flight-recorder-dump-on-timeout '
      '--disable-flight-recorder-dump-on-timeout --flight-recorder-include-stack-trace '
      '--no-flight-recorder-include-only-active --disable-flight-recorder-include-only-active '
      '--no-flight-recorder-extra-dump-on-exec --disable-flight-recorder-extra-dump-on-exec '
      '--log-memory-interval= --log-device-memory-used --log-energy --log-max-attention-logit '
      '--config-logger-dir= --moe-routing-trace-path= '
      '--moe-routing-trace-max-training-iters= --moe-routing-trace-capture-logits '
      '--moe-routing-trace-capture-hidden-states --moe-routing-trace-dump-weights '
      '--dump-param-to-param-group-map= --result-rejected-tracker-filename= '
      '--check-weight-hash-across-dp-replicas-interval= --gpu-sniff-test-interval= --train-sync-interval= '
      '--enable-experimental --enable-msc --disable-msc'),
    (IGNORED,
      "read only by Megatron-LM's inference engine (text generation server, RL rollouts), not by "
      'pretraining; tools/generate_samples_gpt.py generates here',
      '--use-legacy-static-engine --inference-max-requests= --inference-max-seq-length= '
      '--inference-dynamic-batching --inference-dynamic-batching-buffer-size-gb= '
      '--inference-dynamic-batching-paused-buffer-size-gb= --inference-dynamic-batching-mamba-memory-ratio= '
      '--inference-dynamic-batching-block-size= --inference-dynamic-batching-max-requests= '
      '--inference-dynamic-batching-max-tokens= --inference-dynamic-batching-num-cuda-graphs= '
      '--inference-dynamic-batching-track-paused-request-events '
      '--inference-dynamic-batching-track-generated-token-events --decode-only-cuda-graphs '
      '--inference-cuda-graph-all-prefills --inference-cuda-graph-max-tokens= '
      '--inference-dynamic-batching-unified-memory-level= --enable-chunked-prefill --num-speculative-tokens= '
      '--inference-dynamic-batching-prefix-caching --no-inference-dynamic-batching-prefix-caching '
      '--inference-dynamic-batching-prefix-caching-eviction-policy= '
      '--inference-dynamic-batching-prefix-caching-coordinator-policy= '
      '--inference-dynamic-batching-prefix-caching-routing-alpha= '
      '--inference-dynamic-batching-prefix-caching-mamba-gb= '
      '--inference-dynamic-batching-cuda-graph-mixed-prefill-count= '
      '--inference-dynamic-batching-cuda-graph-sizing-distribution= '
      '--inference-dynamic-batching-sampling-backend= --use-same-sampling-seed-across-dp-ranks '
      '--inference-dynamic-batching-async-sched-mode= --inference-dynamic-batching-logprobs-mode= '
      '--inference-logging-step-interval= --inference-text-gen-server-logging '
      '--no-inference-text-gen-server-logging --inference-wandb-logging --no-inference-wandb-logging '
      '--inference-coordinator-port= --mamba-inference-conv-states-dtype= --mamba-inference-ssm-states-dtype= '
      '--inference-use-synchronous-zmq-collectives --no-inference-use-synchronous-zmq-collectives '
      '--inference-disable-ep-consensus --no-inference-disable-ep-consensus --inference-shards= '
      '--inference-cuda-graph-scope= --flash-decode --batch-invariant-mode --symmetric-ar-type= '
      '--nccl-all-reduce-for-prefill --inference-fuse-tp-communication --inference-disable-triton-nvls-kernels '
      '--inference-grouped-gemm-backend= --inference-moe-disable-fused-quant-kernels '
      '--inference-moe-token-dispatcher-type= --mlp-chunks-for-prefill= --inference-rng-tracker '
      '--moe-pad-experts-for-cuda-graph-inference --cache-mla-latents --chat-template='),
    (IGNORED,
      "read only with --perform-rl-step (Megatron-LM's RL training), which is refused",
      '--rl-prompts-per-eval= --grpo-prompts-per-step= --grpo-group-size= --rl-generation-lag= '
      '--rl-submission-granularity= --rl-consumption-granularity= --grpo-iterations= --grpo-clamp-eps-lower= '
      '--grpo-clamp-eps-upper= --grpo-kl-beta= --grpo-entropy-term-weight= '
      '--grpo-filter-groups-with-same-reward --langrl-env-config= --rl-default-temperature= --rl-default-top-p= '
      '--rl-default-top-k= --rl-offload-optimizer-during-inference --rl-kv-cache-management-mode= '
      '--rl-persist-cuda-graphs --no-rl-persist-cuda-graphs --rl-partial-rollouts --no-rl-partial-rollouts '
      '--rl-inference-logprobs-is-correction --no-rl-inference-logprobs-is-correction '
      '--rl-importance-sampling-truncation-coef= --rl-use-sequence-packing --no-rl-use-sequence-packing '
      '--rl-sequence-packing-max-sequences-per-bin= --rl-sequence-packing-algo= --rl-training-cuda-graphs '
      '--no-rl-training-cuda-graphs --rl-inference-tensor-model-parallel-size= '
      '--rl-inference-pipeline-model-parallel-size= --rl-inference-expert-model-parallel-size= '
      '--rl-inference-expert-tensor-model-parallel-size= --rl-inference-model-unified-memory-level= '
      '--rl-offload-inference-model-weights-when-idle --no-rl-offload-inference-model-weights-when-idle '
      '--refit-method= --rl-verify-model-weights-swap --no-rl-verify-model-weights-swap --rl-skip-bos-token '
      '--no-rl-skip-bos-token --rl-profile --rl-profile-dir= --rl-inference-parsers=*'),
    (IGNORED,
      "read only with --inprocess-restart (NVIDIA resiliency's in-process restart), which is refused",
      '--inprocess-max-iterations= --inprocess-monitor-thread-interval= --inprocess-monitor-process-interval= '
      '--inprocess-progress-watchdog-interval= --inprocess-heartbeat-interval= --inprocess-soft-timeout= '
      '--inprocess-hard-timeout= --inprocess-heartbeat-timeout= --inprocess-barrier-timeout= '
      '--inprocess-completion-timeout= --inprocess-last-call-wait= --inprocess-termination-grace-time= '
      '--inprocess-granularity= --inprocess-active-world-size= --inprocess-empty-cuda-cache'),
    (IGNORED,
      "read only with --enable-ft-package (NVIDIA resiliency's fault-tolerance heartbeats), which is "
      'refused',
      '--calc-ft-timeouts --ft-num-warmup-iters='),
    (IGNORED,
      'read only with --sft, which is refused',
      '--sft-tokenizer-prompt-format='),
    (IGNORED,
      'read only with --optimizer muon or lion, which megatron_ds does not offer (--optimizer adam|sgd)',
      '--muon-momentum= --muon-no-split-qkv --muon-nesterov --muon-scale-mode= --muon-fp32-matmul-prec= '
      '--muon-coefficient-type= --muon-num-ns-steps= --muon-tp-mode= --muon-extra-scale-factor= '
      '--muon-scalar-optimizer= --lion-beta1= --lion-beta2='),
    (IGNORED,
      'read only with --hybrid-context-parallel (per-sequence context parallel sizes), which is refused',
      '--max-seqlen-per-dp-cp-rank='),
    (IGNORED,
      'read only with --use-megatron-fsdp / --use-torch-fsdp2; DeepSpeed ZeRO keeps its own buffers',
      '--outer-dp-sharding-strategy= --enable-full-sharding-in-hsdp --torch-fsdp2-no-reshard-after-forward '
      '--megatron-fsdp-main-params-dtype= --megatron-fsdp-main-grads-dtype= --megatron-fsdp-grad-comm-dtype= '
      '--no-strict-fsdp-dtensor-load --disable-strict-fsdp-dtensor-load'),
    (IGNORED,
      'read only with --optimizer-cpu-offload, which is refused',
      '--optimizer-offload-fraction= --use-torch-optimizer-for-cpu-offload'),
    (IGNORED,
      "read only with --tokenizer-type NullTokenizer's padding/eod overrides of Megatron-LM's SFT and RL "
      "paths; NullTokenizer's eod here is its last id, as upstream's default",
      '--null-tokenizer-eod-id= --null-tokenizer-pad-id='),
    (IGNORED,
      "read only with Megatron-LM's async checkpoint worker; the async save here runs its own worker "
      'process',
      '--async-strategy= --async-ckpt-cpu-priority= --async-ckpt-io-priority= --async-ckpt-use-cpu-shm'),
    (IGNORED,
      "tunes Megatron-LM's distributed (torch_dist) checkpoint format; megatron_ds writes and reads its own "
      'format (docs/checkpoints.md)',
      '--auto-detect-ckpt-format --no-ckpt-fully-parallel-save --ckpt-fully-parallel-save '
      '--ckpt-fully-parallel-load --ckpt-fully-parallel-load-exchange-algo= '
      '--ckpt-fully-parallel-save-process-group= --ckpt-fully-parallel-load-process-group= '
      '--ckpt-assume-constant-structure --no-ckpt-load-validate-sharding-integrity '
      '--disable-ckpt-load-validate-sharding-integrity --dist-ckpt-strictness= --dist-ckpt-save-pre-mcore-014 '
      '--dist-ckpt-optim-fully-reshardable --distrib-optim-fully-reshardable-mem-efficient --use-dist-ckpt '
      '--dist-ckpt-format= --dist-ckpt-workers= --no-stream-ckpt-dequant --disable-stream-ckpt-dequant'),
    (IGNORED,
      "checkpoints here are always checked against their manifest's checksums (checkpoint/integrity.py)",
      '--verify-integrity'),
    (IGNORED,
      'the same samples: it only changes how Megatron-LM builds or opens the .bin/.idx files and their '
      'index caches',
      '--no-mmap-bin-files --num-dataset-builder-threads= --dataloader-fast-cache-load '
      '--dataloader-defer-npy-index-mmap --per-dataset-sequences-path='),
    (IGNORED,
      "the data loader here builds no attention mask: causal masking is the attention kernel's (and "
      "--reset-attention-mask's document mask is the model's)",
      '--no-create-attention-mask-in-dataloader'),
    (IGNORED,
      "a warning switch of Megatron-LM's tokenizer checks for pad tokens; no sample changes",
      '--allow-ambiguous-pad-tokens'),
    (IGNORED,
      "a tolerance of Megatron-LM's blended-dataset index sizes; blends here draw exactly their weights' "
      "share (Megatron-DeepSpeed's blending)",
      '--mid-level-dataset-surplus='),
    (IGNORED,
      'SIGTERM/SIGUSR1 handling (save and exit) is on by default here',
      '--exit-signal-handler-for-dataloader --exit-signal-handler-for-training'),
    (IGNORED,
      'the weights are initialised here as Megatron does, on the CPU generator then moved: the same values '
      'whatever the device',
      '--init-model-with-meta-device'),
    (IGNORED,
      "read only with Transformer Engine's custom FP8 recipe and FP4 formats, which are refused",
      '--fp8-quantizer-factory= --fp4-quantizer-factory= --fp4-recipe='),
    (IGNORED,
      'a Megatron-LM experimental-feature gate; the features it gates are answered flag by flag',
      '--mamba-training-ssm-states-dtype='),
    (REFUSED,
      "an option of Megatron-LM's MoE that megatron_ds's implementation of it (model/mlm_moe.py, docs/moe.md) "
      'does not have; drop it',
      '--expert-tensor-parallel-num-weight-shards= --moe-shared-expert-glu-interleave-size= '
      '--moe-enable-routing-replay --moe-router-padding-for-quantization --moe-router-padding-for-fp8 '
      '--moe-router-quantile-balancing-ema= '
      '--moe-router-force-load-balancing --moe-router-force-biased= --moe-single-grouped-weight '
      '--moe-single-grouped-bias --moe-input-jitter-eps= '
      '--moe-enable-deepep --moe-flex-dispatcher-backend= --moe-permute-fusion-into-hybridep '
      '--moe-hybridep-pad-uneven-dispatch-inputs --moe-layer-recompute '
      '--moe-apply-probs-on-input --moe-latent-size= --moe-flex-dispatcher-num-sms= --moe-deepep-num-sms= '
      '--moe-hybridep-num-sms= --moe-hybridep-num-blocks-permute= --moe-hybridep-num-blocks-unpermute= '
      '--moe-hybridep-num-sms-preprocessing= --moe-ncclep-static-shape --moe-ncclep-zero-copy '
      '--moe-mlp-glu-interleave-size= --moe-expert-rank-capacity-factor= --moe-paged-stash '
      '--moe-paged-stash-page-size= --moe-paged-stash-buffer-size-factor-cuda= '
      '--moe-paged-stash-buffer-size-factor-cpu= --moe-use-upcycling --moe-upcycling-granularity='),
    (REFUSED,
      'multi-token prediction is not supported; drop it',
      '--mtp-standalone --mtp-num-layers= --mtp-loss-scaling-factor= --mtp-use-repeated-layer '
      '--mtp-detach-heads --mtp-hybrid-override-pattern='),
    (REFUSED,
      'sparse and linear attention variants (DSA, gated delta net) are not supported; attention here is '
      'full softmax attention',
      '--experimental-attention-variant= --dsa-indexer-n-heads= --dsa-indexer-head-dim= --dsa-indexer-topk= '
      '--dsa-indexer-topk-freq= --dsa-indexer-skip-topk-offset= --dsa-indexer-loss-coeff= '
      '--dsa-indexer-use-sparse-loss --dsa-kernel-backend= --dsa-indexer-rope-interleaved '
      '--no-dsa-indexer-rotate-activation --disable-dsa-indexer-rotate-activation --no-dsa-indexer-scoring-relu '
      '--disable-dsa-indexer-scoring-relu --dsa-indexer-k-norm-epsilon= --dsa-indexer-k-norm-fp32 '
      '--linear-conv-kernel-dim= --linear-key-head-dim= --linear-value-head-dim= --linear-num-key-heads= '
      '--linear-num-value-heads= --linear-attention-freq='),
    (REFUSED,
      'Mamba and hybrid models are not supported (GPT, BERT and T5 transformers only)',
      '--is-hybrid-model --mamba-state-dim= --mamba-head-dim= --mamba-num-groups= --mamba-num-heads= '
      '--disable-mamba-mem-eff-path --hybrid-layer-pattern= --hybrid-override-pattern= --spec=* '
      '--heterogeneous-layers-config-path= --heterogeneous-layers-config-encoded-json='),
    (REFUSED,
      'muP parametrisation is not supported; drop it and set --init-method-std',
      '--use-mup --mup-width-mult= --mup-base-hidden-size= --mup-embedding-mult= --mup-output-mult= '
      '--mup-base-head-dim= --mup-attn-scale-power='),
    (REFUSED,
      "is not supported: the attention here is Llama/GPT's (rotary or learned positions, optional GQA); "
      'drop it',
      '--qk-l2-norm --qk-clip --qk-clip-alpha= --qk-clip-threshold= '
      '--attention-output-gate --activation-func-clamp-value= --rotary-interleaved '
      '--window-attn-skip-freq= --no-rope-freq= --mrope-section=+ --quick-geglu'),
    (REFUSED,
      "YaRN as the position embedding (--position-embedding-type yarn) is not supported; Llama 3.1's scaling is "
      "--use-rope-scaling, linear --rotary-seq-len-interpolation-factor (multi-latent attention's YaRN takes "
      "--rotary-scaling-factor --mscale --mscale-all-dim and, as Megatron-LM's, original 4096 positions, betas 32/1)",
      '--yarn-original-max-position-embeddings= --yarn-beta-fast= --yarn-beta-slow= '
      '--yarn-correction-range-round-to-int --no-yarn-correction-range-round-to-int'),
    (REFUSED,
      'is not supported; the embedding initialises with --init-method-std',
      '--embedding-init-method-std='),
    (REFUSED,
      "FP4 and Transformer Engine's FP8 variants are not supported; FP8 here is torchao's (--fp8-format "
      'e4m3|hybrid, docs/fp8.md)',
      '--fp8-output-proj --first-last-layers-bf16 --num-layers-at-start-in-bf16= --num-layers-at-end-in-bf16= '
      '--fp4-format= --fp4-param-gather --te-precision-config-file='),
    (REFUSED,
      'activation and optimizer offloading to the host is not supported that way; use DeepSpeed ZeRO '
      'offload: --cpu-optimizer',
      '--cpu-offloading-num-layers= --cpu-offloading-retain-pinned-cpu-buffers '
      '--fine-grained-activation-offloading --offload-modules=+ --min-offloaded-tensor-size= '
      '--delay-offload-until-cuda-graph --delta-offload-bytes-across-pp-ranks= --activation-offload-fraction= '
      '--fine-grained-offloading-max-inflight-offloads= --optimizer-cpu-offload'),
    (REFUSED,
      'a layout string is not supported; give uneven stages by --decoder-first/last-pipeline-num-layers, '
      '--account-for-embedding/loss-in-pipeline-split or --pipeline-partition-method layers:N1,...,Np',
      '--pipeline-model-parallel-layout='),
    (REFUSED,
      "is not supported: the interleaved schedule here runs Megatron's default grouping (the pipeline size)",
      '--microbatch-group-size-per-virtual-pipeline-stage='),
    (REFUSED,
      'per-sequence (hybrid) context parallel sizes are not supported; use --context-parallel-size N',
      '--hybrid-context-parallel'),
    (REFUSED,
      'tensor parallel weight sharding beyond --tensor-model-parallel-size is not supported; drop it',
      '--tensor-parallel-num-weight-shards='),
    (REFUSED,
      "is not supported; torch's defaults apply (run the same command twice to check reproducibility on "
      'CPU)',
      '--deterministic-mode --disable-bf16-reduced-precision-matmul'),
    (REFUSED,
      'PyTorch FSDP2 is not supported; use DeepSpeed ZeRO: --zero-stage 3',
      '--use-torch-fsdp2'),
    (REFUSED,
      'more than one distributed-optimizer instance is not supported; --use-distributed-optimizer shards '
      'over all data parallel ranks (ZeRO 1)',
      '--num-distributed-optimizer-instances='),
    (REFUSED,
      'is not supported; the collectives use --distributed-timeout-minutes throughout',
      '--distributed-timeout-seconds-after-init='),
    (REFUSED,
      'a fake process group runs no training; --dry-run checks a layout without one',
      '--fake-process-group'),
    (REFUSED,
      "is not supported; gradients accumulate and reduce in fp32 with --bf16 (or in bf16 with --grad-reduce-in-bf16)",
      '--ddp-reduce-scatter-with-fp32-accumulation --ddp-param-name-patterns-for-fp32-local-accumulation=+'),
    (REFUSED,
      "Megatron-LM's precision-aware optimizer is not supported; DeepSpeed keeps fp32 master weights and "
      'moments',
      '--use-precision-aware-optimizer'),
    (REFUSED,
      "decreasing the batch size to fit the data parallel size is not supported; give a --global-batch-size "
      "that --micro-batch-size x DP divides",
      '--decrease-batch-size-if-needed'),
    (REFUSED,
      'skipping iterations is not supported; a non-finite loss stops every rank (docs/failures.md)',
      '--iterations-to-skip=+'),
    (REFUSED,
      'cannot be turned off: a non-finite loss or gradient norm stops every rank here '
      '(checkpoint/health.py)',
      '--no-check-for-nan-in-loss-and-grad'),
    (REFUSED,
      'is not supported; a non-finite loss or gradient norm stops every rank (checkpoint/health.py)',
      '--check-for-large-grads --check-for-spiky-loss --error-injection-type='),
    (REFUSED,
      "Megatron-LM's RL training is not part of megatron_ds, which pretrains; drop it",
      '--perform-rl-step'),
    (REFUSED,
      "NVIDIA resiliency's in-process restart is not supported; the job script restarts from the last "
      'checkpoint (docs/failures.md)',
      '--inprocess-restart'),
    (REFUSED,
      "NVIDIA resiliency's fault-tolerance package is not supported; hung ranks are named by "
      '--distributed-timeout-minutes',
      '--enable-ft-package'),
    (REFUSED,
      'fault injection is not supported; failures are tested with kill -9 and signals (docs/failures.md)',
      '--fault-injector-ranks= --fault-injector-num-ranks= --fault-injector-fault-types= '
      '--fault-injector-fault-probabilities= --fault-injector-fault-delay= '
      '--fault-injector-delay-start-iteration= --fault-injector-mtti-seconds= --fault-injector-offset-seconds= '
      '--fault-injector-seed='),
    (REFUSED,
      'supervised fine-tuning datasets are not supported; pretrain or use tools/tasks.py for classification '
      'fine-tuning',
      '--sft'),
    (REFUSED,
      'knowledge distillation is not part of megatron_ds, which pretrains; drop it',
      '--logits-save-top-k= --logits-save-top-p= --logits-save-top-p-min-k= --logits-save-dir= '
      '--logits-save-dtype= --logits-load-dir= --logits-load-decode-threads= --logits-load-prefetch-factor= '
      '--logits-load-msc-prefetch-depth= --logits-load-kd-loss-alpha= --logits-load-ignore-errors'),
    (REFUSED,
      'non-persistent (local or in-memory) checkpoints are not supported; save with --save-interval',
      '--non-persistent-save-interval= --non-persistent-ckpt-type= --non-persistent-global-ckpt-dir= '
      '--non-persistent-local-ckpt-dir= --non-persistent-local-ckpt-algo= --replication --replication-jump= '
      '--replication-factor='),
    (REFUSED,
      'saving parameters, activations or gradients for debugging is not supported; drop it',
      '--save-params-interval= --save-activations-interval= --save-tokens-per-expert-interval= '
      '--save-wgrads-interval= --save-dgrads-interval='),
    (REFUSED,
      'is not supported; every saved checkpoint is kept (remove old ones yourself)',
      '--save-retain-interval='),
    (REFUSED,
      'is not supported; --load resumes the fp32 master weights DeepSpeed saved',
      '--load-main-params-from-ckpt'),
    (REFUSED,
      'is not supported; --use-checkpoint-args takes the model flags from the checkpoint',
      '--use-mp-args-from-checkpoint-args'),
    (REFUSED,
      'is not supported; the tokenizer comes from the command line',
      '--no-use-tokenizer-model-from-checkpoint-args --disable-use-tokenizer-model-from-checkpoint-args'),
    (REFUSED,
      'checkpoint format conversion runs offline here: tools/checkpoint/convert.py (and from_hf.py / '
      'to_hf.py)',
      '--ckpt-convert-format= --ckpt-convert-save= --ckpt-convert-update-legacy-dist-opt-format'),
    (REFUSED,
      'is not supported; --load resumes the iteration in latest_checkpointed_iteration.txt',
      '--override-ckpt-iteration='),
    (REFUSED,
      'freezing all layers is not supported; drop it',
      '--freeze-all-layers'),
    (REFUSED,
      'is not supported; warm-up starts from 0 as in Megatron-DeepSpeed',
      '--lr-warmup-init='),
    (REFUSED,
      "is not supported; every weight except biases and norms decays (Megatron's default)",
      '--no-weight-decay-cond-type='),
    (REFUSED,
      'validation uses the training batch sizes here; drop it',
      '--eval-global-batch-size= --eval-micro-batch-size='),
    (REFUSED,
      'is not supported; validation runs every --eval-interval from the start',
      '--start-eval-at-iter='),
    (REFUSED,
      'is not supported; validate with --eval-iters N (or tools/evaluate.py on a checkpoint)',
      '--test-mode --full-validation'),
    (REFUSED,
      'several named validation sets are not supported; give one with --valid-data-path',
      '--multiple-validation-sets --validation-set-names=+'),
    (REFUSED,
      'is not supported; give the data on the command line (--data-path, --train-data-path ...)',
      '--phase-transition-iterations= --data-args-path= --per-split-data-args-path= --yaml-cfg='),
    (REFUSED,
      'object storage is not supported; give local paths to --data-path',
      '--object-storage-cache-path='),
    (REFUSED,
      'is not supported; --reset-attention-mask masks attention across documents',
      '--dataloader-inter-document-masking'),
    (REFUSED,
      'fill-in-the-middle data is not supported; drop it',
      '--fim-data --fim-rate= --fim-spm-rate= --fim-split-sample= --fim-fragment-rate= --fim-no-prefix= '
      '--fim-prefix-token= --fim-middle-token= --fim-suffix-token= --fim-pad-token= --fim-eod-token='),
    (REFUSED,
      'is not supported; the vocabulary pads to a multiple of --make-vocab-size-divisible-by x TP',
      '--padded-vocab-size= --no-pad-vocab-size --disable-pad-vocab-size'),
    (REFUSED,
      'is not supported; the tokenizer is read as is from --tokenizer-model',
      '--tokenizer-metadata= --tokenizer-sentencepiece-legacy '
      '--no-tokenizer-sentencepiece-ignore-extra-whitespaces '
      '--disable-tokenizer-sentencepiece-ignore-extra-whitespaces --tokenizer-hf-no-use-fast'),
    (IGNORED,
      "the torch profiler is the one --profile runs here (without this flag Megatron-LM opens an nsys capture "
      "range instead: run under nsys with --capture-range=none for that)",
      '--use-pytorch-profiler'),
    (IGNORED,
      "selects Megatron Core's model classes over the legacy ones, the same GPT; megatron_ds's own layers run here",
      '--use-mcore-models'),
    (IGNORED,
      "selects an attention kernel for the same softmax attention; here torch's scaled_dot_product_attention picks "
      "flash or memory-efficient attention (logged at start-up)",
      '--attention-backend='),
    (IGNORED,
      "selects a fused cross-entropy kernel for the same loss; here the vocabulary-parallel cross entropy of "
      "parallel/cross_entropy.py runs (liger's fused one with --use-liger-kernel)",
      '--cross-entropy-loss-fusion --cross-entropy-fusion-impl='),
    (IGNORED,
      "Megatron-LM's rerun state machine re-runs an iteration to tell a transient fault from a persistent one; "
      "here a non-finite loss or gradient norm stops every rank (checkpoint/health.py)",
      '--rerun-mode='),
)


def _nargs(token: str) -> tuple[str, int | str]:
    flag, _, spec = token.partition("=")
    return flag, (0 if "=" not in token else spec or 1)


def _flags(kind: str) -> dict[str, tuple[int | str, str]]:
    return {flag: (nargs, why) for k, why, tokens in _TABLE if k == kind
            for flag, nargs in map(_nargs, tokens.split())}


# flag -> (argparse nargs, why it changes nothing here)
MEGATRON_LM_IGNORED = _flags(IGNORED)
# flag -> (argparse nargs, what to use instead)
MEGATRON_LM_REFUSED = _flags(REFUSED)


# flag -> (argparse nargs, the values accepted, what an accepted value means here (None: nothing to say), why
# another value is refused and what to use instead): flags whose upstream default is what megatron_ds does
VALUES: dict[str, tuple[int | str, tuple[str, ...], str | None, str]] = {
    # Megatron-LM's default is transformer_engine (Megatron-DeepSpeed's local): Transformer Engine's layers compute
    # the same transformer as Megatron's own; FP8, where asked, follows --fp8-format / --fp8-recipe (docs/fp8.md)
    "--transformer-impl": (1, ("local", "transformer_engine"),
                           "megatron_ds's own layers run, which compute what Transformer Engine's and Megatron's "
                           "local ones do; FP8 follows --fp8-format / --fp8-recipe (docs/fp8.md)",
                           "the inference-optimized layers are Megatron-LM's inference engine's; train with local "
                           "or transformer_engine"),
    "--softmax-type": (1, ("vanilla",), None, "only the standard softmax is supported"),
    "--glu-linear-offset": (1, ("0", "0.0"), None, "an offset in the gated linear unit is not supported"),
    "--mlp-chunks-for-training": (1, ("1",), None, "chunking the MLP is not supported (the same values); drop it"),
    "--exit-signal": (1, ("SIGTERM", "SIGUSR1", "15", "10"),
                      "SIGTERM and SIGUSR1 both save a checkpoint and exit here (docs/failures.md)",
                      "only SIGTERM and SIGUSR1 save and exit here"),
    **{flag: (1, ("fp32",), None, "DeepSpeed keeps fp32 master weights, gradients and Adam moments; drop it")
       for flag in ("--main-grads-dtype", "--main-params-dtype", "--exp-avg-dtype", "--exp-avg-sq-dtype")},
    "--error-injection-rate": (1, ("0",), None, "error injection is not supported; failures are tested with kill -9 "
                                                "and signals (docs/failures.md)"),
    "--recompute-modules": ("+", ("core_attn",), None,
                            "selective recomputation here recomputes core attention only (Megatron's default); use "
                            "--recompute-granularity full to recompute whole layers"),
    "--ckpt-format": (1, ("torch", "torch_dist"),
                      "megatron_ds writes and reads its own checkpoint format (Megatron-DeepSpeed's layout, "
                      "docs/checkpoints.md), whatever the format named",
                      "the torch_dcp and fsdp_dtensor formats are not supported; drop it (megatron_ds writes its own)"),
}
