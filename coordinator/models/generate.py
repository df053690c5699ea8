#!/usr/bin/env python3
"""Generates the built-in model specs of `poseidon plan` (coordinator/models/*.json).

Each spec is a poseidon.v1.ModelSpec in protobuf's JSON mapping: the model's parameter tensors in
forward order, each with its kind, shape and per-sample forward/backward FLOPs, derived from the
published architectures (sources in each spec's "description"). FLOP conventions (README.md):
  conv   forward = 2 * out * (in / groups) * kh * kw * Hout * Wout   (2 FLOPs per multiply-add)
  fc     forward = 2 * M * N
  bias   forward = number of outputs it is added to (Hout * Wout * C, or M for an FC bias)
  BN     scale and shift: forward = C * H * W each (one multiply / one add per element)
  every layer: backward = 2 * forward (gradient w.r.t. input and w.r.t. weights)
Parameter-free layers (ReLU, pooling, LRN, dropout, softmax) carry no tensor and are not counted.

Usage:
  generate.py            write the JSON files next to this script
  generate.py --check    exit 1 if a committed file differs from what this script generates
  generate.py --summary  print parameters and forward GFLOPs per sample of every model
"""

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def out_size(n, k, stride, pad, ceil_mode=False):
    """Output length of a convolution or pooling window along one axis."""
    span = n + 2 * pad - k
    if ceil_mode:
        out = -(-span // stride) + 1
        # Caffe / PyTorch: the last window must start inside the (left-padded) input.
        if (out - 1) * stride >= n + pad:
            out -= 1
        return out
    return span // stride + 1


class Spec:
    """A model under construction: activations are (channels, height, width) tuples."""

    def __init__(self, name, description):
        self.name = name
        self.description = description
        self.layers = []

    def _add(self, name, kind, shape, forward_flops):
        if any(layer["name"] == name for layer in self.layers):
            raise ValueError(f"{self.name}: duplicate layer {name}")
        self.layers.append({
            "name": name,
            "kind": kind,
            "shape": shape,
            "forward_flops": forward_flops,
            "backward_flops": 2 * forward_flops,
        })

    def conv(self, name, x, out, kh, kw=None, stride=1, pad=0, groups=1, bias=True, bn=False):
        """A convolution with optional bias and batchnorm; returns the output activation."""
        kw = kh if kw is None else kw
        ph, pw = pad if isinstance(pad, tuple) else (pad, pad)
        c, h, w = x
        if c % groups or out % groups:
            raise ValueError(f"{name}: channels not divisible by groups")
        ho, wo = out_size(h, kh, stride, ph), out_size(w, kw, stride, pw)
        macs = out * (c // groups) * kh * kw * ho * wo
        self._add(f"{name}.weight", "LAYER_KIND_CONV", [out, c // groups, kh, kw], 2 * macs)
        if bias:
            self._add(f"{name}.bias", "LAYER_KIND_BIAS", [out], out * ho * wo)
        y = (out, ho, wo)
        if bn:
            self.batchnorm(bn if isinstance(bn, str) else f"{name}.bn", y)
        return y

    def batchnorm(self, name, x):
        c, h, w = x
        self._add(f"{name}.scale", "LAYER_KIND_OTHER", [c], c * h * w)
        self._add(f"{name}.shift", "LAYER_KIND_OTHER", [c], c * h * w)
        return x

    def fc(self, name, x, out, bias=True):
        """A fully connected layer on the flattened activation; weight [M, N] = [out, in]."""
        n = x[0] * x[1] * x[2]
        self._add(f"{name}.weight", "LAYER_KIND_FC", [out, n], 2 * out * n)
        if bias:
            self._add(f"{name}.bias", "LAYER_KIND_BIAS", [out], out)
        return (out, 1, 1)

    @staticmethod
    def pool(x, k, stride, pad=0, ceil_mode=False):
        c, h, w = x
        return (c, out_size(h, k, stride, pad, ceil_mode), out_size(w, k, stride, pad, ceil_mode))

    @staticmethod
    def concat(*xs):
        assert all(x[1:] == xs[0][1:] for x in xs), xs
        return (sum(x[0] for x in xs), xs[0][1], xs[0][2])

    def parameters(self):
        total = 0
        for layer in self.layers:
            n = 1
            for d in layer["shape"]:
                n *= d
            total += n
        return total

    def forward_flops(self):
        return sum(layer["forward_flops"] for layer in self.layers)

    def to_json(self):
        lines = ["{", f'  "name": "{self.name}",', f'  "description": "{self.description}",',
                 '  "layers": [']
        for i, layer in enumerate(self.layers):
            shape = ", ".join(str(d) for d in layer["shape"])
            sep = "," if i + 1 < len(self.layers) else ""
            lines.append(
                f'    {{"name": "{layer["name"]}", "kind": "{layer["kind"]}", "shape": [{shape}], '
                f'"element_type": "ELEMENT_TYPE_F32", "forward_flops": {layer["forward_flops"]}, '
                f'"backward_flops": {layer["backward_flops"]}}}{sep}')
        lines += ["  ]", "}", ""]
        return "\n".join(lines)


# ---- AlexNet -------------------------------------------------------------------------------------

def alexnet():
    s = Spec("alexnet",
             "AlexNet (Krizhevsky et al., NIPS 2012) as in Caffe's BVLC reference model: 227x227 "
             "input, two-group conv2/conv4/conv5 (weights [out, in/groups, kh, kw]), biases, "
             "no parameters in LRN/pooling.")
    x = (3, 227, 227)
    x = s.conv("conv1", x, 96, 11, stride=4)
    x = s.pool(x, 3, 2)
    x = s.conv("conv2", x, 256, 5, pad=2, groups=2)
    x = s.pool(x, 3, 2)
    x = s.conv("conv3", x, 384, 3, pad=1)
    x = s.conv("conv4", x, 384, 3, pad=1, groups=2)
    x = s.conv("conv5", x, 256, 3, pad=1, groups=2)
    x = s.pool(x, 3, 2)
    x = s.fc("fc6", x, 4096)
    x = s.fc("fc7", x, 4096)
    s.fc("fc8", x, 1000)
    return s


# ---- VGG -----------------------------------------------------------------------------------------

def vgg(name, convs_per_stage, classes, description):
    s = Spec(name, description)
    x = (3, 224, 224)
    for stage, (count, width) in enumerate(zip(convs_per_stage, (64, 128, 256, 512, 512)), 1):
        for i in range(1, count + 1):
            x = s.conv(f"conv{stage}_{i}", x, width, 3, pad=1)
        x = s.pool(x, 2, 2)
    x = s.fc("fc6", x, 4096)
    x = s.fc("fc7", x, 4096)
    s.fc("fc8", x, classes)
    return s


VGG_SOURCE = "(Simonyan and Zisserman, ICLR 2015)"


def vgg16():
    return vgg("vgg16", (2, 2, 3, 3, 3), 1000,
               f"VGG16, configuration D {VGG_SOURCE}: 224x224 input, 13 3x3 convolutions and 3 FC "
               "layers with biases.")


def vgg19():
    return vgg("vgg19", (2, 2, 4, 4, 4), 1000,
               f"VGG19, configuration E {VGG_SOURCE}: 224x224 input, 16 3x3 convolutions and 3 FC "
               "layers with biases.")


def vgg19_22k():
    return vgg("vgg19-22k", (2, 2, 4, 4, 4), 21841,
               f"VGG19 {VGG_SOURCE} with a 21,841-class fc8 for ImageNet-22K, the model of the "
               "Poseidon paper (Zhang et al., USENIX ATC 2017).")


# ---- GoogLeNet -----------------------------------------------------------------------------------

def googlenet():
    s = Spec("googlenet",
             "GoogLeNet (Szegedy et al., CVPR 2015, Table 1) as in Caffe's BVLC model: 224x224 "
             "input, biases, 5x5 branches, ceil-mode pooling; WITHOUT the two auxiliary "
             "classifiers (training-only heads, about 6.3M parameters more).")
    x = (3, 224, 224)
    x = s.conv("conv1/7x7_s2", x, 64, 7, stride=2, pad=3)
    x = s.pool(x, 3, 2, ceil_mode=True)
    x = s.conv("conv2/3x3_reduce", x, 64, 1)
    x = s.conv("conv2/3x3", x, 192, 3, pad=1)
    x = s.pool(x, 3, 2, ceil_mode=True)

    def inception(name, x, c1, c3r, c3, c5r, c5, pp):
        b1 = s.conv(f"{name}/1x1", x, c1, 1)
        b3 = s.conv(f"{name}/3x3_reduce", x, c3r, 1)
        b3 = s.conv(f"{name}/3x3", b3, c3, 3, pad=1)
        b5 = s.conv(f"{name}/5x5_reduce", x, c5r, 1)
        b5 = s.conv(f"{name}/5x5", b5, c5, 5, pad=2)
        bp = s.conv(f"{name}/pool_proj", s.pool(x, 3, 1, pad=1), pp, 1)
        return s.concat(b1, b3, b5, bp)

    x = inception("inception_3a", x, 64, 96, 128, 16, 32, 32)
    x = inception("inception_3b", x, 128, 128, 192, 32, 96, 64)
    x = s.pool(x, 3, 2, ceil_mode=True)
    x = inception("inception_4a", x, 192, 96, 208, 16, 48, 64)
    x = inception("inception_4b", x, 160, 112, 224, 24, 64, 64)
    x = inception("inception_4c", x, 128, 128, 256, 24, 64, 64)
    x = inception("inception_4d", x, 112, 144, 288, 32, 64, 64)
    x = inception("inception_4e", x, 256, 160, 320, 32, 128, 128)
    x = s.pool(x, 3, 2, ceil_mode=True)
    x = inception("inception_5a", x, 256, 160, 320, 32, 128, 128)
    x = inception("inception_5b", x, 384, 192, 384, 48, 128, 128)
    x = (x[0], 1, 1)  # 7x7 average pooling
    s.fc("loss3/classifier", x, 1000)
    return s


# ---- Inception-V3 --------------------------------------------------------------------------------

def inception_v3():
    s = Spec("inception-v3",
             "Inception-V3 (Szegedy et al., CVPR 2016) as in torchvision's inception_v3: 299x299 "
             "input, every convolution without bias followed by batchnorm (scale and shift), "
             "WITHOUT the auxiliary classifier (3.3M parameters more).")

    def basic(name, x, out, kh, kw=None, stride=1, pad=0):
        return s.conv(f"{name}.conv", x, out, kh, kw, stride=stride, pad=pad, bias=False,
                      bn=f"{name}.bn")

    def block_a(name, x, pool_features):
        b1 = basic(f"{name}.branch1x1", x, 64, 1)
        b5 = basic(f"{name}.branch5x5_1", x, 48, 1)
        b5 = basic(f"{name}.branch5x5_2", b5, 64, 5, pad=2)
        bd = basic(f"{name}.branch3x3dbl_1", x, 64, 1)
        bd = basic(f"{name}.branch3x3dbl_2", bd, 96, 3, pad=1)
        bd = basic(f"{name}.branch3x3dbl_3", bd, 96, 3, pad=1)
        bp = basic(f"{name}.branch_pool", s.pool(x, 3, 1, pad=1), pool_features, 1)
        return s.concat(b1, b5, bd, bp)

    def block_b(name, x):
        b3 = basic(f"{name}.branch3x3", x, 384, 3, stride=2)
        bd = basic(f"{name}.branch3x3dbl_1", x, 64, 1)
        bd = basic(f"{name}.branch3x3dbl_2", bd, 96, 3, pad=1)
        bd = basic(f"{name}.branch3x3dbl_3", bd, 96, 3, stride=2)
        return s.concat(b3, bd, s.pool(x, 3, 2))

    def block_c(name, x, c7):
        b1 = basic(f"{name}.branch1x1", x, 192, 1)
        b7 = basic(f"{name}.branch7x7_1", x, c7, 1)
        b7 = basic(f"{name}.branch7x7_2", b7, c7, 1, 7, pad=(0, 3))
        b7 = basic(f"{name}.branch7x7_3", b7, 192, 7, 1, pad=(3, 0))
        bd = basic(f"{name}.branch7x7dbl_1", x, c7, 1)
        bd = basic(f"{name}.branch7x7dbl_2", bd, c7, 7, 1, pad=(3, 0))
        bd = basic(f"{name}.branch7x7dbl_3", bd, c7, 1, 7, pad=(0, 3))
        bd = basic(f"{name}.branch7x7dbl_4", bd, c7, 7, 1, pad=(3, 0))
        bd = basic(f"{name}.branch7x7dbl_5", bd, 192, 1, 7, pad=(0, 3))
        bp = basic(f"{name}.branch_pool", s.pool(x, 3, 1, pad=1), 192, 1)
        return s.concat(b1, b7, bd, bp)

    def block_d(name, x):
        b3 = basic(f"{name}.branch3x3_1", x, 192, 1)
        b3 = basic(f"{name}.branch3x3_2", b3, 320, 3, stride=2)
        b7 = basic(f"{name}.branch7x7x3_1", x, 192, 1)
        b7 = basic(f"{name}.branch7x7x3_2", b7, 192, 1, 7, pad=(0, 3))
        b7 = basic(f"{name}.branch7x7x3_3", b7, 192, 7, 1, pad=(3, 0))
        b7 = basic(f"{name}.branch7x7x3_4", b7, 192, 3, stride=2)
        return s.concat(b3, b7, s.pool(x, 3, 2))

    def block_e(name, x):
        b1 = basic(f"{name}.branch1x1", x, 320, 1)
        b3 = basic(f"{name}.branch3x3_1", x, 384, 1)
        b3a = basic(f"{name}.branch3x3_2a", b3, 384, 1, 3, pad=(0, 1))
        b3b = basic(f"{name}.branch3x3_2b", b3, 384, 3, 1, pad=(1, 0))
        bd = basic(f"{name}.branch3x3dbl_1", x, 448, 1)
        bd = basic(f"{name}.branch3x3dbl_2", bd, 384, 3, pad=1)
        bda = basic(f"{name}.branch3x3dbl_3a", bd, 384, 1, 3, pad=(0, 1))
        bdb = basic(f"{name}.branch3x3dbl_3b", bd, 384, 3, 1, pad=(1, 0))
        bp = basic(f"{name}.branch_pool", s.pool(x, 3, 1, pad=1), 192, 1)
        return s.concat(b1, b3a, b3b, bda, bdb, bp)

    x = (3, 299, 299)
    x = basic("Conv2d_1a_3x3", x, 32, 3, stride=2)
    x = basic("Conv2d_2a_3x3", x, 32, 3)
    x = basic("Conv2d_2b_3x3", x, 64, 3, pad=1)
    x = s.pool(x, 3, 2)
    x = basic("Conv2d_3b_1x1", x, 80, 1)
    x = basic("Conv2d_4a_3x3", x, 192, 3)
    x = s.pool(x, 3, 2)
    x = block_a("Mixed_5b", x, 32)
    x = block_a("Mixed_5c", x, 64)
    x = block_a("Mixed_5d", x, 64)
    x = block_b("Mixed_6a", x)
    x = block_c("Mixed_6b", x, 128)
    x = block_c("Mixed_6c", x, 160)
    x = block_c("Mixed_6d", x, 160)
    x = block_c("Mixed_6e", x, 192)
    x = block_d("Mixed_7a", x)
    x = block_e("Mixed_7b", x)
    x = block_e("Mixed_7c", x)
    x = (x[0], 1, 1)  # global average pooling
    s.fc("fc", x, 1000)
    return s


# ---- ResNet --------------------------------------------------------------------------------------

def resnet(name, blocks_per_stage):
    s = Spec(name,
             f"ResNet-{sum(blocks_per_stage) * 3 + 2} (He et al., CVPR 2016, Table 1) with "
             "bottleneck blocks and projection shortcuts on the first block of each stage "
             "(option B), stride in the first 1x1 convolution as in the paper; convolutions "
             "without bias, each followed by batchnorm (scale and shift); torchvision names.")
    x = (3, 224, 224)
    x = s.conv("conv1", x, 64, 7, stride=2, pad=3, bias=False, bn="bn1")
    x = s.pool(x, 3, 2, pad=1)
    for stage, (count, width) in enumerate(zip(blocks_per_stage, (64, 128, 256, 512)), 1):
        for b in range(count):
            stride = 2 if (b == 0 and stage > 1) else 1
            p = f"layer{stage}.{b}"
            y = s.conv(f"{p}.conv1", x, width, 1, stride=stride, bias=False, bn=f"{p}.bn1")
            y = s.conv(f"{p}.conv2", y, width, 3, pad=1, bias=False, bn=f"{p}.bn2")
            y = s.conv(f"{p}.conv3", y, width * 4, 1, bias=False, bn=f"{p}.bn3")
            if b == 0:
                s.conv(f"{p}.downsample.conv", x, width * 4, 1, stride=stride, bias=False,
                       bn=f"{p}.downsample.bn")
            x = y
    x = (x[0], 1, 1)  # global average pooling
    s.fc("fc", x, 1000)
    return s


def resnet50():
    return resnet("resnet-50", (3, 4, 6, 3))


def resnet152():
    return resnet("resnet-152", (3, 8, 36, 3))


MODELS = [alexnet, vgg16, vgg19, vgg19_22k, googlenet, inception_v3, resnet50, resnet152]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    parser.add_argument("--summary", action="store_true", help="print parameters and FLOPs")
    parser.add_argument("--out", default=HERE, help="directory of the JSON files")
    args = parser.parse_args()
    stale = []
    for make in MODELS:
        spec = make()
        path = os.path.join(args.out, f"{spec.name}.json")
        text = spec.to_json()
        if args.summary:
            print(f"{spec.name:14s} {len(spec.layers):4d} tensors {spec.parameters():12,d} "
                  f"parameters {spec.forward_flops() / 1e9:8.2f} GFLOP forward per sample")
        if args.check:
            try:
                with open(path, encoding="utf-8") as f:
                    if f.read() != text:
                        stale.append(path)
            except FileNotFoundError:
                stale.append(path)
        elif not args.summary:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
    if stale:
        print("stale model specs (run coordinator/models/generate.py): " + " ".join(stale),
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
