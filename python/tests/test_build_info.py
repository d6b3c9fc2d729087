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


def test_video_feature_matches_video_loader(tmp_path):
    # The features list is the build's: VideoLoader decodes exactly when `video` is listed.
    has = "video" in flowgate.build_info()["features"]
    (tmp_path / "clips.txt").write_text("")
    try:
        flowgate.VideoLoader(tmp_path / "clips.txt")
    except RuntimeError as e:
        assert not has and "without video support" in str(e)
    except (OSError, ValueError) as e:
        assert has, e
    else:
        assert has
