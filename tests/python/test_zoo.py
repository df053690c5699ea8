#!/usr/bin/python3
"""The model zoo through Poseidon's DistributedDataParallel (ctest python_pytorch_zoo).

Each model (tests/python/zoo.py: ResNet-18 with BatchNorm, a small GPT with AdamW parameter
groups and clip_grad_norm_, an LSTM language model with tied embeddings, a model with branches
unused on some steps and a Conv3d stem, gradient accumulation with no_sync(), bf16 autocast on
the CPU, bf16 parameters) is trained for 20 steps on 2 and on 4 workers, by the scheme named
(ps, sfb or the planner's auto), and compared with
- one process on the P-times larger global batch (zoo.reference), and
- torch DDP over gloo, the same script with torch's wrapper (where gloo can: not bf16 params).
The parameters (and BatchNorm's running statistics) must agree within the spec's tolerance
relative to each tensor's norm, or within 3x DDP's own difference to the reference where that
is larger (Adam's division by sqrt(v) turns rounding noise in gradients that are zero in exact
arithmetic, such as attention's key bias, into visible steps; DDP shows the same).

Also: K for SFB is the rows of the flattened input (a transformer with 1,024 tokens per worker is
planned PS, its 64-token version may go SFB), a job resumed from a checkpoint equals the
uninterrupted run, and misuse gets one clear error naming the layer.

Environment: as tests/python/test_pytorch.py (PYTHONPATH, POSEIDON_BUILD_DIR).
"""
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
# The launcher helpers (and torch, or the skip without it) of the PyTorch tests.
from test_pytorch import PY, free_port, launch as launch_cluster, torch  # noqa: E402
import zoo  # noqa: E402

WORKER = os.path.join(HERE, "zoo_worker.py")


def launch(workers, args, scheme="auto", timeout=600, options=()):
    return launch_cluster(["-n", str(workers), "--scheme", scheme, *options, "--", PY, WORKER,
                           *args], timeout=timeout)


class ZooTest(unittest.TestCase):
    def poseidon(self, model, workers, scheme, tmp, extra=(), options=()):
        out = os.path.join(tmp, f"{model}-{workers}-{scheme}.pt")
        r = launch(workers, ["poseidon", model, out, *extra], scheme, options=options)
        self.assertEqual(r.returncode, 0, (r.stdout + r.stderr)[-6000:])
        return torch.load(out), r.stdout

    def ddp(self, model, workers, tmp):
        out = os.path.join(tmp, f"{model}-{workers}-ddp.pt")
        for attempt in range(3):  # the port is chosen before gloo binds it: retry a lost race
            r = subprocess.run([PY, WORKER, "ddp", model, out, str(workers), str(free_port())],
                               capture_output=True, text=True, timeout=600)
            if r.returncode == 0:
                return torch.load(out), r.stdout
        self.fail(f"torch DDP failed: {r.stderr[-3000:]}")

    @staticmethod
    def gradient_check(stdout):
        line = next(l for l in stdout.splitlines() if "gradient check: worst" in l)
        return float(line.split("worst ")[1].split()[0]), line

    def check_teacher_forced(self, spec, workers, scheme, tmp, what):
        """Every step's averaged gradient against one process's on the same parameters, as
        close as DDP's; every rank's final parameters and buffers equal to rank 0's."""
        _, stdout = self.poseidon(spec.name, workers, scheme, tmp)
        err, line = self.gradient_check(stdout)
        _, ddp_stdout = self.ddp(spec.name, workers, tmp)
        ddp_err, ddp_line = self.gradient_check(ddp_stdout)
        bound = max(spec.tolerance, 3 * ddp_err)
        self.assertLessEqual(err, bound, f"{what}: {line} (DDP: {ddp_line})")
        out = os.path.join(tmp, f"{spec.name}-{workers}-{scheme}.pt")
        rank0 = torch.load(f"{out}.rank0")
        for r in range(1, workers):
            diff, where = zoo.difference(torch.load(f"{out}.rank{r}"), rank0)
            self.assertEqual(diff, 0.0, f"{what}: rank {r} differs from rank 0 at {where}")
        return stdout

    def check(self, model, workers, scheme="auto", expect=()):
        spec = zoo.SPECS[model]
        with tempfile.TemporaryDirectory() as tmp:
            if spec.teacher_forced:
                return self.check_teacher_forced(spec, workers, scheme, tmp,
                                                 f"{model}, {workers} workers, {scheme}")
            got, stdout = self.poseidon(model, workers, scheme, tmp)
            for text in expect:
                self.assertIn(text, stdout)
            want = zoo.state(zoo.reference(spec, workers))
            bound, what = spec.tolerance, f"{model}, {workers} workers, {scheme}"
            if spec.ddp:
                ddp, _ = self.ddp(model, workers, tmp)
                ddp_err, _ = zoo.difference(ddp, want)
                self.assertLess(ddp_err, 0.05, f"{what}: DDP itself is far from the reference")
                bound = max(bound, 3 * ddp_err)
                err, where = zoo.difference(got, ddp)
                self.assertLessEqual(err, bound, f"{what}: against DDP {err:.2e} at {where} "
                                                 f"(bound {bound:.2e}, DDP vs reference "
                                                 f"{ddp_err:.2e})")
            err, where = zoo.difference(got, want)
            self.assertLessEqual(err, bound, f"{what}: against one process {err:.2e} at {where} "
                                             f"(bound {bound:.2e})")
            return stdout


class Zoo(ZooTest):
    def test_resnet18_batchnorm_2_workers_auto(self):
        self.check("resnet18", 2)

    def test_resnet18_batchnorm_4_workers_ps(self):
        self.check("resnet18", 4, "ps")

    def test_gpt_adamw_groups_and_clipping_2_workers_auto(self):
        self.check("gpt", 2, expect=["clipped on 20 of 20 steps"])

    def test_gpt_4_workers_sfb_on_three_dimensional_inputs(self):
        # Forced SFB: linear1/linear2/head see [batch, tokens, features]; K = batch x tokens.
        out = self.check("gpt", 4, "sfb", expect=["head.weight=SFB", "blocks.0.linear1.weight=SFB",
                                                   "clipped on 20 of 20 steps"])
        # MultiheadAttention's out_proj runs without its module's forward: PS, never SFB.
        self.assertIn("blocks.0.self_attn.out_proj.weight=PS", out)

    def test_lstm_tied_embeddings_2_workers_auto(self):
        out = self.check("lstm", 2, expect=["clipped on"])
        # The tied weight is one layer (its gradient summed once), under its first name.
        self.assertRegex(out, r"encoder\.weight=(PS|AR)\b")
        self.assertNotIn("decoder.weight", out)

    def test_lstm_4_workers_ps(self):
        self.check("lstm", 4, "ps")

    def test_unused_branches_and_a_5d_weight_2_workers_auto(self):
        out = self.check("branch", 2, expect=["stem.weight="])
        self.assertNotIn("stem.weight=SFB", out)  # a 5-D weight is never an FC layer

    def test_unused_branches_4_workers_ps(self):
        self.check("branch", 4, "ps")

    def test_no_sync_gradient_accumulation_2_workers_auto(self):
        # The first forward runs inside no_sync(): planned without SFB.
        self.check("accumulate", 2, expect=["SFB layers: 0 of"])

    def test_no_sync_gradient_accumulation_4_workers_ps(self):
        self.check("accumulate", 4, "ps")

    def test_bf16_autocast_2_workers_auto(self):
        self.check("bf16", 2)

    def test_bf16_autocast_4_workers_sfb(self):
        self.check("bf16", 4, "sfb", expect=["fc1.weight=SFB"])

    def test_bf16_parameters_2_workers_auto(self):
        self.check("bf16-params", 2)

    def test_bf16_parameters_4_workers_sfb(self):
        self.check("bf16-params", 4, "sfb", expect=["fc2.weight=SFB"])


@unittest.skipUnless(torch.cuda.is_available(),
                     "needs a CUDA device: torch.cuda.is_available() is False")
class CudaZoo(ZooTest):
    """The DDP contract on cuda:0 (2 ranks share the GPU): the end-of-backward callback's waits on
    the current stream, the probe with CUDA tensors, SFB on 3-D inputs, no_sync and unused
    parameters, against one process on the same GPU."""

    def check_cuda(self, model, scheme, expect=()):
        spec = zoo.SPECS[model]
        with tempfile.TemporaryDirectory() as tmp:
            got, out = self.poseidon(model, 2, scheme, tmp, extra=["--device", "cuda:0"])
        for text in expect:
            self.assertIn(text, out)
        torch.backends.cuda.matmul.allow_tf32 = False
        want = zoo.state(zoo.reference(spec, 2, device="cuda:0"))
        err, where = zoo.difference(got, want)
        self.assertLessEqual(err, max(spec.tolerance, 1e-4), f"{model} on CUDA: {err:.2e} at {where}")

    def test_cuda_gpt_sfb(self):
        self.check_cuda("gpt", "sfb", expect=["head.weight=SFB", "clipped on 20 of 20"])

    def test_cuda_accumulate_and_branch(self):
        self.check_cuda("accumulate", "auto")
        self.check_cuda("branch", "ps")


class Planning(ZooTest):
    def test_k_is_the_rows_of_the_flattened_input(self):
        # 4 sequences x 256 tokens = 1,024 rows per worker: SFB would move 2*1024*(P-1)*(M+N)
        # numbers against PS's 2*M*N, so auto plans PS; 64 rows (the gpt spec) may go SFB.
        # On the nominal network (10 Gbit/s, 50 us): a probe on a loaded host can measure a
        # round trip of milliseconds, and then SFB's one latency against PS's two wins honestly.
        with tempfile.TemporaryDirectory() as tmp:
            _, out = self.poseidon("gpt-long", 2, "auto", tmp, extra=["1"], options=["--no-probe"])
        self.assertIn("SFB layers: 0 of", out)
        self.assertIn("K: blocks.0.linear1.weight=1024", out)

    def test_resume_from_a_checkpoint_equals_the_uninterrupted_run(self):
        with tempfile.TemporaryDirectory() as tmp:
            ckpt = os.path.join(tmp, "ckpt.pt")
            whole, _ = self.poseidon("gpt", 2, "auto", tmp, extra=["20"])
            first = os.path.join(tmp, "first.pt")
            r = launch(2, ["poseidon", "gpt", first, "10", "--save", ckpt])
            self.assertEqual(r.returncode, 0, (r.stdout + r.stderr)[-4000:])
            second = os.path.join(tmp, "second.pt")
            r = launch(2, ["poseidon", "gpt", second, "20", "--resume", ckpt])
            self.assertEqual(r.returncode, 0, (r.stdout + r.stderr)[-4000:])
            self.assertIn("resumed at step 10", r.stdout)
            err, where = zoo.difference(torch.load(second), whole)
            # The same sums in the same order: equal up to the summation order at the server.
            self.assertLessEqual(err, 1e-5, f"resumed run differs by {err:.2e} at {where}")


class Misuse(unittest.TestCase):
    def run_code(self, code, workers=2):
        return launch_cluster(["-n", str(workers), "--scheme", "sfb", "--", PY, "-c", code])

    def test_a_batch_larger_than_the_first_on_an_sfb_layer_names_the_layer(self):
        code = ("import torch, poseidon, poseidon.torch; poseidon.init(); "
                "m = poseidon.torch.DistributedDataParallel(torch.nn.Sequential("
                "torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))); "
                "m(torch.randn(3, 4)).sum().backward(); m(torch.randn(2, 4)).sum().backward(); "
                "print('a smaller batch trains'); m(torch.randn(5, 4)).sum().backward()")
        r = self.run_code(code)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("a smaller batch trains", r.stdout)
        self.assertIn("0.weight is synchronised by SFB with K = 3 rows", r.stdout + r.stderr)
        self.assertIn("= 5 rows", r.stdout + r.stderr)

    def test_a_parameter_without_gradient_names_it_and_suggests_find_unused(self):
        code = ("import torch, poseidon, poseidon.torch; poseidon.init(); "
                "net = torch.nn.ModuleDict(dict(a=torch.nn.Linear(4, 4), b=torch.nn.Linear(4, 4))); "
                "net.forward = lambda x: net['a'](x); "
                "m = poseidon.torch.DistributedDataParallel(net); "
                "m(torch.randn(3, 4)).sum().backward()")
        r = self.run_code(code)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("no gradient was produced for b.weight, b.bias", r.stdout + r.stderr)
        self.assertIn("find_unused_parameters=True", r.stdout + r.stderr)

    def test_float64_parameters_are_refused_clearly(self):
        code = ("import torch, poseidon, poseidon.torch; poseidon.init(); "
                "m = poseidon.torch.DistributedDataParallel(torch.nn.Linear(4, 2).double()); "
                "m(torch.randn(3, 4, dtype=torch.float64))")
        r = self.run_code(code, workers=1)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("weight: parameters of type torch.float64 are not supported", r.stdout + r.stderr)


if __name__ == "__main__":
    unittest.main()
