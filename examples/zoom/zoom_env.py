"""The zoom example's environment: a turn that says "<zoom>" is shown the centre mark, cropped
from the full-resolution image; any other turn ends the trajectory (the reward recipes score
its answer)."""

from PIL import Image

from vlrft.multiturn.environment import Step


class CentreZoom:
    observation_role = "user"  # the crop comes back as a user turn: image, then this text

    def __init__(self, text: str = "Zoomed in on the centre mark."):
        self.text = text

    def reset(self, sample: dict) -> None:
        self.path, self.box = sample["meta"]["full_image"], tuple(sample["meta"]["zoom_box"])
        self.zoomed = False

    def step(self, action: str) -> Step:
        if "<zoom>" not in action or self.zoomed:
            return Step("", done=True)
        self.zoomed = True
        with Image.open(self.path) as full:
            crop = full.convert("RGB").crop(self.box)
        return Step(self.text, images=[crop])
