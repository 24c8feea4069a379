"""A small ImageNet-format dataset, built once and cached.

Real PNG files in ``train/`` and ``val/``, list files of ``path label``
lines (``train.txt``, ``val.txt``) and a mean image (``mean.npy``): the
same inputs the example takes for real ImageNet.  Eight classes of drawn
shapes on noisy backgrounds, so a model learns something in a minute.
"""

import os

import numpy

CLASSES = ('circle', 'square', 'triangle', 'cross', 'hstripes', 'vstripes',
           'ring', 'diamond')
VERSION = '1'


def _draw(kind, size, rng):
    from PIL import Image, ImageDraw
    background = rng.randint(0, 256, size=(size, size, 3)).astype(numpy.uint8)
    background = (background // 3 + rng.randint(0, 170, size=3)).astype(
        numpy.uint8)
    img = Image.fromarray(background)
    draw = ImageDraw.Draw(img)
    color = tuple(int(c) for c in rng.randint(0, 256, size=3))
    r = rng.randint(size // 5, size // 3)
    cx, cy = rng.randint(r + 2, size - r - 2, size=2)
    box = (cx - r, cy - r, cx + r, cy + r)
    width = max(2, r // 3)
    if kind == 'circle':
        draw.ellipse(box, fill=color)
    elif kind == 'square':
        draw.rectangle(box, fill=color)
    elif kind == 'triangle':
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)],
                     fill=color)
    elif kind == 'cross':
        draw.rectangle((cx - r, cy - width, cx + r, cy + width), fill=color)
        draw.rectangle((cx - width, cy - r, cx + width, cy + r), fill=color)
    elif kind == 'hstripes':
        for y in range(cy - r, cy + r, 2 * width):
            draw.rectangle((cx - r, y, cx + r, y + width - 1), fill=color)
    elif kind == 'vstripes':
        for x in range(cx - r, cx + r, 2 * width):
            draw.rectangle((x, cy - r, x + width - 1, cy + r), fill=color)
    elif kind == 'ring':
        draw.ellipse(box, outline=color, width=width)
    elif kind == 'diamond':
        draw.polygon([(cx, cy - r), (cx + r, cy), (cx, cy + r), (cx - r, cy)],
                     fill=color)
    return img


def build(root, n_train=80, n_val=20, size=72, seed=0):
    """Create the dataset under ``root`` unless it is already there.

    Returns (train list, val list, mean file, image root).
    """
    lists = tuple(os.path.join(root, f) for f in
                  ('train.txt', 'val.txt', 'mean.npy'))
    done = os.path.join(root, 'COMPLETE')
    if os.path.exists(done) and open(done).read() == VERSION:
        return lists + (root,)
    rng = numpy.random.RandomState(seed)
    total = numpy.zeros((3, size, size))
    for split, n in (('train', n_train), ('val', n_val)):
        os.makedirs(os.path.join(root, split), exist_ok=True)
        lines = []
        for label, kind in enumerate(CLASSES):
            for i in range(n):
                rel = os.path.join(split, '%s_%03d.png' % (kind, i))
                img = _draw(kind, size, rng)
                img.save(os.path.join(root, rel))
                if split == 'train':
                    total += numpy.asarray(img, numpy.float64).transpose(2, 0, 1)
                lines.append('%s %d\n' % (rel, label))
        with open(os.path.join(root, split + '.txt'), 'w') as f:
            f.writelines(lines)
    numpy.save(lists[2], (total / (n_train * len(CLASSES))).astype(
        numpy.float32))
    with open(done, 'w') as f:
        f.write(VERSION)
    return lists + (root,)
