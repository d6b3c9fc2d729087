"""An existing torchvision-style Dataset moved to flowgate with a one-line change.

    pip install ./python torch torchvision pillow
    python examples/python/map_dataset.py target/sample-data/images.txt
    torchrun --nproc_per_node=2 examples/python/map_dataset.py target/sample-data/images.txt

The Dataset is the user's own (PIL decode, torchvision transforms, an int label); only the
DataLoader line changes. flowgate makes batches (`dataset[i]`, then the collate) on threads
the tuner sizes, deals each
rank an equal share under torchrun, and its state_dict resumes an epoch exactly: the script
stops half way through the first epoch, saves the checkpoint, and resumes from it.
"""

import sys

import torch
from PIL import Image
from torch.utils.data import Dataset
from torchvision import transforms

import flowgate


class Photos(Dataset):
    """The user's Dataset, unchanged."""

    def __init__(self, list_file):
        with open(list_file) as f:
            self.paths = [line.strip() for line in f if line.strip()]
        self.transform = transforms.Compose([
            transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        with Image.open(self.paths[i]) as im:
            return self.transform(im.convert("RGB")), i % 10


def main() -> None:
    images = sys.argv[1] if len(sys.argv) > 1 else "target/sample-data/images.txt"
    dataset = Photos(images)
    # Was: torch.utils.data.DataLoader(dataset, batch_size=32, shuffle=True, num_workers=8,
    #                                  drop_last=True)
    loader = flowgate.DataLoader(dataset, batch_size=32, shuffle=True, num_workers=8,
                                 drop_last=True)
    model = torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(8), torch.nn.Flatten(),
                                torch.nn.Linear(3 * 8 * 8, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    checkpoint = None
    for epoch in range(2):
        loader.set_epoch(epoch)
        for step, (x, y) in enumerate(loader):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if epoch == 0 and step == len(loader) // 2:
                checkpoint = {"model": model.state_dict(), "loader": loader.state_dict()}
                break  # a preemption, half way through the first epoch
        stats = loader.stats()
        print(f"epoch {epoch}: {stats['delivered']} batches, fetch threads "
              f"{stats['stages']['fetch']['workers']}: {stats['gil']['threads_busy']:.1f} "
              f"busy on {stats['gil']['cores_used']:.1f} cores")
        if checkpoint is not None and epoch == 0:
            # A new process would build the same loader and load the checkpoint.
            resumed = flowgate.DataLoader(dataset, batch_size=32, shuffle=True, num_workers=8,
                                          drop_last=True)
            resumed.load_state_dict(checkpoint["loader"])
            rest = sum(1 for _ in resumed)
            print(f"resumed epoch 0: the remaining {rest} of {len(loader)} batches")


if __name__ == "__main__":
    main()
