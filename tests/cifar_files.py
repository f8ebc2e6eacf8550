"""CIFAR-100 in its on-disk format, written by the tests. A plain module, not conftest: a
child process imports it to write the files, and importing conftest would give that child a
temporary folder of its own and a new TMPDIR."""
import io
import os
import pickle
import struct

import numpy as np


class _Python2Pickler(pickle._Pickler):
    """Pickles every bytes object as a Python 2 `str`, as the original CIFAR-100
    files were written (protocol 2, by Python 2). Read back with
    encoding="latin1" (torchvision's way) the keys are str and the image buffer is
    decoded by numpy; with encoding="bytes" the keys are b"data", b"fine_labels", ...
    Python 3's own pickle would turn bytes keys into objects that stay bytes, which
    is not what the original files hold."""
    dispatch = dict(pickle._Pickler.dispatch)

    def _save_python2_str(self, obj):
        if len(obj) < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([len(obj)]) + obj)
        else:
            self.write(pickle.BINSTRING + struct.pack("<i", len(obj)) + obj)
        self.memoize(obj)

    dispatch[bytes] = _save_python2_str


def dump_as_python2(obj, path):
    buffer = io.BytesIO()
    _Python2Pickler(buffer, protocol=2).dump(obj)
    # The release names numpy's classes as numpy 1 did (numpy 2 writes numpy._core): GLOBAL opcodes, text lines.
    with open(path, "wb") as f:
        f.write(buffer.getvalue().replace(b"cnumpy._core.", b"cnumpy.core."))


def write_cifar100(root, train_images, train_labels, test_images, test_labels):
    """<root>/cifar-100-python/{train,test,meta} as in the CIFAR-100 python release:
    images N x 3 x 32 x 32 uint8 are stored as rows of 3072 bytes (R plane, G, B)."""
    folder = os.path.join(root, "cifar-100-python")
    os.makedirs(folder, exist_ok=True)
    for split, images, labels in (("train", train_images, train_labels), ("test", test_images, test_labels)):
        images = np.ascontiguousarray(images, dtype=np.uint8)
        assert images.shape[1:] == (3, 32, 32)
        n = len(images)
        dump_as_python2({
            b"batch_label": f"{split}ing batch 1 of 1".encode(),
            b"filenames": [b"image_%05d.png" % i for i in range(n)],
            b"fine_labels": [int(x) for x in labels],
            b"coarse_labels": [int(x) // 5 for x in labels],  # differ from the fine labels on purpose
            b"data": images.reshape(n, 3072),
        }, os.path.join(folder, split))
    dump_as_python2({b"fine_label_names": [b"class_%02d" % i for i in range(100)],
                     b"coarse_label_names": [b"superclass_%02d" % i for i in range(20)]}, os.path.join(folder, "meta"))
