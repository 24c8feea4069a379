"""ImageNet classifiers for the example, each ending in global average
pooling (or lazily sized fully connected layers), so they accept any crop
size from about 32 pixels up: 224 for ImageNet, 64 for the embedded set."""

import chainer
import chainer.functions as F
import chainer.links as L


class _Classifier(chainer.Chain):

    def __call__(self, x, t):
        y = self.forward(x)
        loss = F.softmax_cross_entropy(y, t)
        chainer.report({'loss': loss, 'accuracy': F.accuracy(y, t)}, self)
        return loss


class NIN(_Classifier):
    """Network in Network (Lin et al., 2014), as in Chainer's example."""

    def __init__(self, n_classes=1000):
        super(NIN, self).__init__()
        w = chainer.initializers.HeNormal()
        with self.init_scope():
            self.mlpconv1 = L.MLPConvolution2D(
                None, (96, 96, 96), 11, stride=4, conv_init=w)
            self.mlpconv2 = L.MLPConvolution2D(
                None, (256, 256, 256), 5, pad=2, conv_init=w)
            self.mlpconv3 = L.MLPConvolution2D(
                None, (384, 384, 384), 3, pad=1, conv_init=w)
            self.mlpconv4 = L.MLPConvolution2D(
                None, (1024, 1024, n_classes), 3, pad=1, conv_init=w)

    def forward(self, x):
        h = F.max_pooling_2d(F.relu(self.mlpconv1(x)), 3, stride=2)
        h = F.max_pooling_2d(F.relu(self.mlpconv2(h)), 3, stride=2)
        h = F.max_pooling_2d(F.relu(self.mlpconv3(h)), 3, stride=2)
        h = self.mlpconv4(F.dropout(h))
        return F.mean(h, axis=(2, 3))


class Alex(_Classifier):
    """AlexNet (Krizhevsky et al., 2012), fully connected layers sized
    lazily from the crop."""

    def __init__(self, n_classes=1000):
        super(Alex, self).__init__()
        with self.init_scope():
            self.conv1 = L.Convolution2D(None, 96, 11, stride=4)
            self.conv2 = L.Convolution2D(None, 256, 5, pad=2)
            self.conv3 = L.Convolution2D(None, 384, 3, pad=1)
            self.conv4 = L.Convolution2D(None, 384, 3, pad=1)
            self.conv5 = L.Convolution2D(None, 256, 3, pad=1)
            self.fc6 = L.Linear(None, 4096)
            self.fc7 = L.Linear(None, 4096)
            self.fc8 = L.Linear(None, n_classes)

    def forward(self, x):
        h = F.max_pooling_2d(F.local_response_normalization(
            F.relu(self.conv1(x))), 3, stride=2)
        h = F.max_pooling_2d(F.local_response_normalization(
            F.relu(self.conv2(h))), 3, stride=2)
        h = F.relu(self.conv3(h))
        h = F.relu(self.conv4(h))
        h = F.max_pooling_2d(F.relu(self.conv5(h)), 3, stride=2)
        h = F.dropout(F.relu(self.fc6(h)))
        h = F.dropout(F.relu(self.fc7(h)))
        return self.fc8(h)


class _Bottleneck(chainer.Chain):

    def __init__(self, in_ch, mid, out, stride):
        super(_Bottleneck, self).__init__()
        w = chainer.initializers.HeNormal()
        with self.init_scope():
            self.conv1 = L.Convolution2D(in_ch, mid, 1, stride, 0,
                                         initialW=w, nobias=True)
            self.bn1 = L.BatchNormalization(mid)
            self.conv2 = L.Convolution2D(mid, mid, 3, 1, 1,
                                         initialW=w, nobias=True)
            self.bn2 = L.BatchNormalization(mid)
            self.conv3 = L.Convolution2D(mid, out, 1, 1, 0,
                                         initialW=w, nobias=True)
            self.bn3 = L.BatchNormalization(out)
            if stride != 1 or in_ch != out:
                self.conv4 = L.Convolution2D(in_ch, out, 1, stride, 0,
                                             initialW=w, nobias=True)
                self.bn4 = L.BatchNormalization(out)

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        h = F.relu(self.bn2(self.conv2(h)))
        h = self.bn3(self.conv3(h))
        shortcut = self.bn4(self.conv4(x)) if hasattr(self, 'conv4') else x
        return F.relu(h + shortcut)


class ResNet50(_Classifier):
    """ResNet-50 (He et al., 2016) as in Chainer's example: 162 parameter
    arrays, 25,557,096 values with 1000 classes."""

    def __init__(self, n_classes=1000):
        super(ResNet50, self).__init__()
        with self.init_scope():
            self.conv1 = L.Convolution2D(3, 64, 7, 2, 3,
                                         initialW=chainer.initializers
                                         .HeNormal())
            self.bn1 = L.BatchNormalization(64)
            stages = []
            in_ch = 64
            for i, (n, mid, out) in enumerate(((3, 64, 256), (4, 128, 512),
                                               (6, 256, 1024),
                                               (3, 512, 2048))):
                blocks = chainer.ChainList()
                for b in range(n):
                    stride = 2 if (b == 0 and i > 0) else 1
                    blocks.add_link(_Bottleneck(in_ch, mid, out, stride))
                    in_ch = out
                stages.append(blocks)
            self.res2, self.res3, self.res4, self.res5 = stages
            self.fc = L.Linear(2048, n_classes)

    def forward(self, x):
        h = F.max_pooling_2d(F.relu(self.bn1(self.conv1(x))), 3, stride=2)
        for stage in (self.res2, self.res3, self.res4, self.res5):
            for block in stage:
                h = block(h)
        return self.fc(F.mean(h, axis=(2, 3)))


class SmallConvNet(_Classifier):
    """Four 3x3 convolutions with batch normalization, each halving the
    image, then two fully connected layers: learns the embedded set in a
    minute on 2 CPU cores (the default there; NIN, Chainer's default for
    ImageNet, needs many more epochs to start learning)."""

    def __init__(self, n_classes=1000):
        super(SmallConvNet, self).__init__()
        w = chainer.initializers.HeNormal()
        with self.init_scope():
            for i, channels in enumerate((16, 32, 64, 128)):
                setattr(self, 'conv%d' % i, L.Convolution2D(
                    None, channels, 3, pad=1, initialW=w, nobias=True))
                setattr(self, 'bn%d' % i, L.BatchNormalization(channels))
            self.fc1 = L.Linear(None, 512, initialW=w)
            self.fc2 = L.Linear(512, n_classes)

    def forward(self, x):
        h = x
        for i in range(4):
            h = getattr(self, 'bn%d' % i)(getattr(self, 'conv%d' % i)(h))
            h = F.max_pooling_2d(F.relu(h), 2)
        return self.fc2(F.dropout(F.relu(self.fc1(h))))


ARCHS = {'nin': NIN, 'alex': Alex, 'resnet50': ResNet50,
         'smallcnn': SmallConvNet}
