import loci.formats.ImageReader;
import loci.formats.FormatTools;

// Reads every tile of each DICOM file named as Bio-Formats' DicomReader does (QuPath's and Fiji's
// reader) and prints "PATH WIDTH HEIGHT BYTES_PER_PIXEL SUM MAX" of its 16-bit samples.
// Run as a single-file program: java -cp bioformats_package.jar BioFormatsReadAll.java FILE...
public class BioFormatsReadAll {
    public static void main(String[] args) throws Exception {
        loci.common.DebugTools.setRootLevel("ERROR");
        for (String path : args) {
            ImageReader reader = new ImageReader();
            reader.setId(path);
            int w = reader.getSizeX(), h = reader.getSizeY();
            int bpp = FormatTools.getBytesPerPixel(reader.getPixelType());
            boolean little = reader.isLittleEndian();
            long sum = 0; int max = 0;
            int tw = reader.getOptimalTileWidth(), th = reader.getOptimalTileHeight();
            for (int y = 0; y < h; y += th) {
                for (int x = 0; x < w; x += tw) {
                    int cw = Math.min(tw, w - x), ch = Math.min(th, h - y);
                    byte[] b = reader.openBytes(0, x, y, cw, ch);
                    for (int i = 0; i + 1 < b.length; i += 2) {
                        int v = little ? ((b[i] & 255) | (b[i + 1] & 255) << 8) : ((b[i] & 255) << 8 | (b[i + 1] & 255));
                        sum += v; max = Math.max(max, v);
                    }
                }
            }
            System.out.println(path + " " + w + " " + h + " " + bpp + " " + sum + " " + max);
            reader.close();
        }
    }
}
