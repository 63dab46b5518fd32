"""Flow control: requests no endpoint can start now wait in the picker (late binding)."""
