"""Maggy's scalar-field approximator trained the way its post writes it: an ordinary single-machine
PyTorch function, train(module, hparams, train_set, test_set), with no distributed code in it."""

import torch


def train(module, hparams, train_set, test_set):  # type: ignore[no-untyped-def]
    model = module(**hparams)
    n_epochs = 2
    batch_size = 64
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_criterion = torch.nn.MSELoss()
    train_loader = torch.utils.data.DataLoader(train_set, batch_size=batch_size, shuffle=True)
    test_loader = torch.utils.data.DataLoader(test_set, batch_size=batch_size)

    for epoch in range(n_epochs):  # noqa: B007 (as a user writes it)
        model.train()
        for x, y in train_loader:
            optimizer.zero_grad()
            prediction = model(x)
            loss = loss_criterion(prediction, y)
            loss.backward()
            optimizer.step()

    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for x, y in test_loader:
            total += loss_criterion(model(x), y).item() * len(x)
            count += len(x)
    return total / count
