"""The ClientApp: Flower's quickstart, plus fedcomp's mod on its uplink."""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedcomp.flower import compression_mod  # fedcomp
from quickstart_compressed.task import Net, load_data
from quickstart_compressed.task import test as test_fn
from quickstart_compressed.task import train as train_fn

torch.set_num_threads(1)
app = ClientApp(mods=[compression_mod])  # fedcomp: the trained model goes up compressed


@app.train()
def train(msg: Message, context: Context) -> Message:
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    trainloader, _ = load_data(int(context.node_config["partition-id"]),
                               int(context.node_config["num-partitions"]))
    loss = train_fn(model, trainloader, int(msg.content["config"]["local-epochs"]),
                    float(msg.content["config"]["lr"]))
    content = RecordDict({
        "arrays": ArrayRecord(model.state_dict()),
        "metrics": MetricRecord({"train_loss": loss,
                                 "num-examples": len(trainloader.dataset)}),
    })
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    _, testloader = load_data(int(context.node_config["partition-id"]),
                              int(context.node_config["num-partitions"]))
    loss, accuracy = test_fn(model, testloader)
    metrics = MetricRecord({"eval_loss": loss, "eval_acc": accuracy,
                            "num-examples": len(testloader.dataset)})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)
