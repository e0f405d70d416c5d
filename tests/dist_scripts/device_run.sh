export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi -L; python3 -c "import torch,tensorboard;print('torch',torch.__version__,torch.cuda.device_count())"
for s in 1 -1; do
 echo "== plain NCCL run slow-rank=$s"
 timeout 150 python3 -m torch.distributed.run --standalone --nproc-per-node 2 tests/dist_scripts/plain_loop.py --cuda --log-dir /tmp/tb$s --steps 300 --every 20 --width 4096 --batch 2048 --slow-rank $s --slow-ms 20 --timeout 60 > $OUT/run$s.log 2>&1; echo "rc=$?"
 grep -E "RESULT|slowest|cost|straggler|gpu (step|forward|backward)" $OUT/run$s.log
 python3 tests/dist_scripts/readback.py /tmp/tb$s
done
echo "== pytest tests/test_dist.py (STEPTIMER_REQUIRE_CUDA=1)"
STEPTIMER_REQUIRE_CUDA=1 timeout 240 python3 -m pytest tests/test_dist.py -q -p no:cacheprovider 2>&1 | tail -15
