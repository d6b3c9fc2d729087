"""flowgate.build_info(): what the installed build has (version, JPEG decoder, features)."""

import flowgate


def test_build_info_describes_this_build():
    info = flowgate.build_info()
    assert isinstance(info, dict)
    assert info["version"] == flowgate.__version__
    assert info["jpeg"] in ("libjpeg-turbo", "zune-jpeg (pure Rust)")
    assert isinstance(info["features"], list)
    assert "image" in info["features"] and "audio" in info["features"]
    assert all(isinstance(f, str) for f in info["features"])
    # The one-line form the command's --version prints.
    assert info["text"].startswith(f"flowgate {flowgate.__version__} (jpeg: {info['jpeg']}; ")
    assert "build_info" in flowgate.__all__


def test_video_feature_matches_video_loader():
    # The features list is the build's: VideoLoader exists exactly when `video` is listed.
    assert ("video" in flowgate.build_info()["features"]) == hasattr(flowgate._native,
                                                                     "video_loader")
