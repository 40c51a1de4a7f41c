"""The model, the data and the training loop: an ordinary Flower quickstart task.

scikit-learn's digits (inside its wheel, so nothing is downloaded), split among
clients with flwr-datasets' IID partitioner.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    """A small CNN for 8x8 digits."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 16, 3, padding=1)
        self.fc1 = nn.Linear(16 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.max_pool2d(torch.relu(self.conv(x)), 2)
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


def _digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return (bunch.images.astype(np.float32) / 16.0)[:, None], bunch.target.astype(np.int64)


def load_data(partition_id: int, num_partitions: int) -> tuple[DataLoader, DataLoader]:
    """This client's train and test loaders (80/20 of its partition)."""
    import datasets
    from flwr_datasets.partitioner import IidPartitioner

    x, y = _digits()
    partitioner = IidPartitioner(num_partitions=num_partitions)
    partitioner.dataset = datasets.Dataset.from_dict({"index": np.arange(len(y))})
    index = np.asarray(partitioner.load_partition(partition_id)["index"])
    cut = int(0.8 * len(index))
    loaders = []
    for part, shuffle in ((index[:cut], True), (index[cut:], False)):
        data = TensorDataset(torch.from_numpy(x[part]), torch.from_numpy(y[part]))
        loaders.append(DataLoader(data, batch_size=32, shuffle=shuffle))
    return loaders[0], loaders[1]


def load_centralized_test() -> DataLoader:
    """Every digit, for the server's evaluation."""
    x, y = _digits()
    return DataLoader(TensorDataset(torch.from_numpy(x), torch.from_numpy(y)), batch_size=256)


def train(net: nn.Module, loader: DataLoader, epochs: int, lr: float) -> float:
    """SGD with momentum; the mean training loss."""
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    net.train()
    total, steps = 0.0, 0
    for _ in range(epochs):
        for images, labels in loader:
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(net(images), labels)
            loss.backward()
            optimizer.step()
            total, steps = total + loss.item(), steps + 1
    return total / max(steps, 1)


@torch.no_grad()
def test(net: nn.Module, loader: DataLoader) -> tuple[float, float]:
    """(loss, accuracy)."""
    net.eval()
    loss, correct, count = 0.0, 0, 0
    for images, labels in loader:
        out = net(images)
        loss += nn.functional.cross_entropy(out, labels, reduction="sum").item()
        correct += int((out.argmax(1) == labels).sum())
        count += len(labels)
    return loss / count, correct / count
