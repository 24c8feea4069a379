"""What is timed: ResNet-50's gradient shapes, as arrays or a Chainer link."""

import numpy


def resnet50_grad_shapes(n_classes=1000):
    """Parameter shapes of ResNet-50 as in Chainer's ImageNet example
    (conv1 with bias, batch normalisation after every convolution)."""
    shapes = [(64, 3, 7, 7), (64,), (64,), (64,)]
    in_ch = 64
    for n_blocks, mid, out in ((3, 64, 256), (4, 128, 512),
                               (6, 256, 1024), (3, 512, 2048)):
        for block in range(n_blocks):
            convs = [(mid, in_ch, 1, 1), (mid, mid, 3, 3), (out, mid, 1, 1)]
            if block == 0:
                convs.append((out, in_ch, 1, 1))  # projection shortcut
            for w in convs:
                shapes += [w, (w[0],), (w[0],)]   # conv W, BN gamma, beta
            in_ch = out
    return shapes + [(n_classes, 2048), (n_classes,)]


def grad_list(shapes, rank, dtype=numpy.float32):
    """[(name, gradient)] as ``mean_grads`` takes them: no Chainer needed."""
    rng = numpy.random.RandomState(rank)
    return [('p%03d' % i, rng.standard_normal(shape).astype(dtype))
            for i, shape in enumerate(shapes)]


def grad_model(shapes, rank, dtype=numpy.float32):
    """A Chainer Link holding ``grad_list``'s gradients (for the cases that
    need Chainer: the optimizer wrapper, ChainerMN)."""
    return link_holding(grad_list(shapes, rank, dtype))


def link_holding(grads):
    """A Chainer Link whose parameters' gradients are ``grads`` (a
    ``grad_list``: the same arrays, not copies)."""
    import chainer
    link = chainer.Link()
    with link.init_scope():
        for name, grad in grads:
            p = chainer.Parameter(numpy.zeros(grad.shape, dtype=grad.dtype))
            p.grad = grad
            setattr(link, name, p)
    return link
