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
VERSION = '2'

#: Image side; the example crops 48 pixels from it (at random in training),
#: and every shape lies inside the central 40, so any crop holds all of it.
SIZE = 56


def _draw(kind, size, rng):
    """One image: a shape of a random colour, size and place on a noisy
    background of another colour, contrasting enough to be seen."""
    from PIL import Image, ImageDraw
    base = rng.randint(0, 256, size=3)
    noise = rng.randint(0, 48, size=(size, size, 3))
    img = Image.fromarray(numpy.clip(base + noise - 24, 0, 255).astype(
        numpy.uint8))
    draw = ImageDraw.Draw(img)
    color = (base + rng.choice([-1, 1], size=3) * rng.randint(
        110, 150, size=3)) % 256    # far from the background in each channel
    color = tuple(int(c) for c in color)
    margin = (size - 40) // 2
    r = rng.randint(11, 17)
    cx, cy = rng.randint(margin + r, size - margin - r + 1, size=2)
    box = (cx - r, cy - r, cx + r, cy + r)
    width = max(3, r // 3)
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


def build(root, n_train=80, n_val=40, size=SIZE, seed=0):
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
